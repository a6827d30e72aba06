"""``python -m mechmon_megatron`` is the ``mechmon`` command."""

import sys

from mechmon_megatron.cli import main

sys.exit(main())
