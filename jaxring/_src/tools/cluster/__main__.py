"""``python -m jaxring._src.cluster ...`` until the ``jaxring`` CLI dispatches to it."""
import sys

from jaxring._src.cluster.cli import main

sys.exit(main())
