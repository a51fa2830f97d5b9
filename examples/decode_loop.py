"""The decode loop: a synthetic sparse-attention model decoding over a hierarchical sparse KV
cache in four modes (gpu-only, offload, overlap, predict), checked bit for bit against gpu-only.

The code is the package's ``hisparse_cupy/demo/`` (``python -m hisparse_cupy demo`` runs the
same); ``--help`` lists every knob.

    python examples/decode_loop.py [--batch 32] [--context 8192] [--steps 200] [--eager]
"""

import sys

from hisparse_cupy._cli import main  # the command line's exit statuses (its --help lists them)

if __name__ == "__main__":
    sys.exit(main(["demo", *sys.argv[1:]]))
