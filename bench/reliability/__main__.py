"""``python -m bench.reliability``: the same run as ``specgate bench reliability``."""

from bench.reliability import main

raise SystemExit(main())
