"""``python -m hisparse_cupy {info,check,demo,bench}``: see :mod:`hisparse_cupy._cli`."""

from ._cli import main

raise SystemExit(main())
