"""``python -m flashmla_cupy``: the ``flashmla-cupy`` command line."""
from .cli import main

raise SystemExit(main())
