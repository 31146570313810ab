"""``python -m aft_vision.cli ARGS``: ``aft-vision ARGS``."""
from .parser import main

raise SystemExit(main())
