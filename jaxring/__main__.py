"""``python -m jaxring ...`` is the ``jaxring`` command."""
from jaxring._src.cli import main

raise SystemExit(main())
