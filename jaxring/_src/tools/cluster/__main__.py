"""``python -m jaxring._src.tools.cluster ...`` until the ``jaxring`` CLI dispatches to it."""
import sys

from jaxring._src.tools.cluster.cli import main

sys.exit(main())
