"""``python -m influkit`` (and ``torchrun -m influkit score CONFIG``): the command-line interface."""

import sys

from .cli import main

sys.exit(main())
