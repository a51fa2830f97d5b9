"""A decode loop over a hierarchical sparse KV cache (the code is hisparse_cupy/demo.py, which
``python -m hisparse_cupy demo`` runs too).

    python examples/decode_loop.py [--steps N] [--requests R]
"""

from hisparse_cupy.demo import main

if __name__ == "__main__":
    main()
