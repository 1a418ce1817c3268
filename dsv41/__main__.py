"""`python -m dsv41` runs the `dsv41` command."""

from .cli import main

raise SystemExit(main())
