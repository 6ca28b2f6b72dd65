"""The ``flashmla-cupy`` profiler: how fast each shape runs against the hardware's limits.

One concept per module, data flowing one way (shapes → inputs → targets → timing → report):

* ``shapes``   the workloads (the seed's MLA grid, seqlen draws, DeepSeek-V3.2's sparse rows, the
               attention sweep) and their cost model: FLOPs and bytes with the seed's and upstream
               FlashMLA's formulas (pure, CPU-only);
* ``timing``   statistics over samples (pure) and CUDA-event timing with an L2 flush or a CUDA graph;
* ``ceilings`` the two roofs measured in the same run (device copy bandwidth, cuBLAS matmul) and
               the bound classification (pure);
* ``inputs``   random inputs on the GPU, laid out as the seed's benchmark lays them out (sparse: an
               FP8 cache and indices);
* ``targets``  what is timed: a name and ``setup(inputs) -> callable`` (FlashMLA, the CuPy baseline,
               the sparse call, the minimal FlashAttention kernel, manual attention);
* ``anchors``  FlashMLA's sparse times from another run, shown beside ours on the same kind of GPU;
* ``env``      device and version facts for headers, ``info`` and the JSON export;
* ``runner``   the profile loops (MLA grid, sparse rows, attention sweep) that produce result records;
* ``report``   the rich table and header, CSV, JSON and the matplotlib plot;
* ``build``    the ``compile`` subcommand (every kernel program, ptxas report, cache hits) and the
               kernels a profile builds before it starts.

Nothing here imports CuPy at module import time except ``inputs``, ``targets`` and ``runner``'s
GPU paths, so ``flashmla-cupy --help``, ``info`` and ``compile`` work on a machine with no GPU.
"""
