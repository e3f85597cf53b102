"""`python -m devstack` (what `make run` starts): the local stack in the foreground."""

from devstack import main

raise SystemExit(main())
