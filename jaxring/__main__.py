"""``python -m jaxring ...`` is the ``jaxring`` command."""
from jaxring._src.tools.cli import main

raise SystemExit(main())
