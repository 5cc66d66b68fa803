"""``python -m fp8kit``: the same command line as the ``fp8kit`` console script (works under torchrun)."""

from fp8kit.cli.main import main

raise SystemExit(main())
