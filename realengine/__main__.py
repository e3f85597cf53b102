"""`python -m realengine [PORT]`."""

from realengine import main

raise SystemExit(main())
