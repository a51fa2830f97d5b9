"""The kernel families and their launch plumbing (internal: the package's face re-exports what
engines call).

One ``.py`` here per ``hisparse_cupy/cu/*.cu`` family: :mod:`.swap` (the single-step resolve,
``cu/swap.cu``), :mod:`.multistep` (gather + commit, ``cu/multistep.cu``; its sizes in
:mod:`.multistep_config`), :mod:`.plan` (the planned copy every bulk row move goes through,
``cu/plan.cu``), :mod:`.newest` (the newest token's rows and backup plan, ``cu/newest.cu``),
:mod:`.sums` (a transfer's per-layer checksum, ``cu/sums.cu``); the Prefetcher's staging kernel
``cu/predict.cu`` is launched by :mod:`hisparse_cupy.streams._predict`. Shared: :mod:`._abi` (the
C++ structs mirrored as NumPy dtypes), :mod:`.build` (one RawModule per source, the name
expressions, :func:`compile_check`), :mod:`.launch` (structs, streams, PDL, launches), and
:mod:`.rows` (the bulk row moves between the host pool and GPU memory that the cache,
residency and PD make: the planned copy, or the copy engines for long runs).
"""
