"""``python -m hisparse_cupy {info,check,demo,bench}``: see :mod:`hisparse_cupy._cli`."""

from ._cli import main

if __name__ == "__main__":  # not in a process that multiprocessing starts (it imports this)
    raise SystemExit(main())
