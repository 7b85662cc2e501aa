"""The machine the cost model plans for: per-worker compute, memory and links.

Each value comes from a flag when given, else from the connected Ray cluster where it
can tell (worker memory, workers per node), else from a documented default for the
device kind:

                        CPU workers (default)         GPU workers (--use_gpu)
  worker_tflops         0.05 x --cpus_per_worker      50 (H100, fp32 without TF32)
                        (GPT-2 training measured at
                        0.045-0.05 per CPU)
    --bf16 / --fp16     the same over 30 (no bf16     400 (H100 tensor cores: 40% of
                        or fp16 arithmetic: autocast  the 989 dense peak, what large
                        emulates it, measured ~30x    models sustain)
                        slower per matmul here)
  worker_memory_gb      16                            80 (H100)
  node_link_gbps        10 (gloo, loopback: ~11       3600 (NVLink 4: 450 GB/s)
                        Gbit/s measured)
  network_gbps          5 (a 25-50 GbE NIC shared     400 (one NDR InfiniBand NIC
                        by a node's workers)          per GPU)
  workers_per_node      8                             8
  latency per message   200 us (gloo, measured)       10 us in a node, 20 us across
  memory bandwidth      10 GB/s per worker            2 TB/s (the optimizer step)
  pipeline overhead     4 ms per stage and micro-     0.2 ms
                        batch (measured 3-6 ms,
                        README: pipeline schedules)
  dropout mask element  4 bytes (CPU: float mask)     1 byte (bool)

The run's precision is part of it: ``compute_bytes`` (2 under --bf16/--fp16: autocast's
matmuls, their inputs and outputs; 4 in fp32 training) and ``reduce_dtype`` (the
gradients on the wire: --reduce_dtype; ``reduce_bytes`` 2 for bfloat16, else 4).

Bandwidths are per worker and direction, Gbit/s on the command line.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

GIB = 2**30

CPU_TFLOPS_PER_CPU = 0.05
GPU_TFLOPS = 50.0
GPU_HALF_TFLOPS = 400.0
CPU_HALF_SLOWDOWN = 30.0
CPU_MEMORY_GB = 16.0
GPU_MEMORY_GB = 80.0
CPU_NODE_LINK_GBPS, GPU_NODE_LINK_GBPS = 10.0, 3600.0
CPU_NETWORK_GBPS, GPU_NETWORK_GBPS = 5.0, 400.0
WORKERS_PER_NODE = 8


@dataclass(frozen=True)
class Hardware:
    worker_flops: float  # FLOP/s one worker sustains on training math
    worker_memory: float  # bytes one worker may use
    workers_per_node: int
    node_link_bw: float  # bytes/s between two workers of one node
    network_bw: float  # bytes/s between workers on different nodes
    latency_node: float  # s per message inside a node
    latency_network: float  # s per message across nodes
    memory_bw: float  # bytes/s of a worker's memory (the optimizer step streams it)
    mask_bytes: int  # one dropout-mask element
    stage_overhead: float = 0.0  # s per pipeline stage and micro-batch (schedule, p2p)
    use_gpu: bool = False
    compute_bytes: int = 4  # autocast's dtype under --bf16/--fp16 (2), else fp32 (4)
    reduce_dtype: str = "float32"  # the gradients summed over dp (--reduce_dtype)

    @property
    def reduce_bytes(self) -> int:
        return 2 if self.reduce_dtype == "bfloat16" else 4
    # where each figure came from: "flag", "cluster" or "default"
    source: dict = field(default_factory=dict, compare=False)

    def describe(self) -> str:
        def src(name):
            s = self.source.get(name, "default")
            return "" if s == "flag" else f" ({s})"
        return (f"{'GPU' if self.use_gpu else 'CPU'} workers: "
                f"{self.worker_flops / 1e12:g} TFLOP/s"
                f"{' (bf16/fp16)' if self.compute_bytes < 4 else ''}{src('worker_tflops')}, "
                f"{self.worker_memory / GIB:g} GiB{src('worker_memory_gb')}, "
                f"{self.workers_per_node} per node{src('workers_per_node')}, links "
                f"{self.node_link_bw * 8 / 1e9:g} Gbit/s in a node{src('node_link_gbps')} "
                f"and {self.network_bw * 8 / 1e9:g} Gbit/s across{src('network_gbps')}")


def cluster_resources(cpus_per_worker: float, use_gpu: bool) -> dict:
    """From the connected Ray cluster (never connects, never imports Ray): the fewest
    workers a node holds and the least memory per worker, {} without a cluster."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return {}
    fits, mems = [], []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        res = node.get("Resources", {})
        fit = int(res.get("CPU", 0) / cpus_per_worker + 1e-9) if cpus_per_worker > 0 else 1
        if use_gpu:
            fit = min(fit, int(res.get("GPU", 0)))
        if fit < 1:
            continue
        fits.append(fit)
        if not use_gpu and res.get("memory"):
            mems.append(res["memory"] / fit)
    out = {}
    if fits:
        out["workers_per_node"] = min(fits)
    if mems:
        out["worker_memory"] = min(mems)
    return out


def hardware_for(cfg, cluster: dict | None = None) -> Hardware:
    """The Hardware of a TrainConfig: flags, then ``cluster`` (cluster_resources), then
    the defaults above."""
    gpu = bool(cfg.use_gpu)
    cluster = cluster if cluster is not None else cluster_resources(cfg.cpus_per_worker, gpu)
    source = {}

    def pick(flag, from_cluster, default):
        value = getattr(cfg, flag, 0) or 0
        if value > 0:
            source[flag] = "flag"
            return value
        if from_cluster is not None:
            source[flag] = "cluster"
            return from_cluster
        source[flag] = "default"
        return default

    half = bool(getattr(cfg, "bf16", False) or getattr(cfg, "fp16", False))
    cpu = CPU_TFLOPS_PER_CPU * max(cfg.cpus_per_worker, 0.25)
    tflops = pick("worker_tflops", None,
                  (GPU_HALF_TFLOPS if half else GPU_TFLOPS) if gpu
                  else cpu / (CPU_HALF_SLOWDOWN if half else 1.0))
    mem_c = cluster.get("worker_memory")
    memory = pick("worker_memory_gb", mem_c / GIB if mem_c else None,
                  GPU_MEMORY_GB if gpu else CPU_MEMORY_GB)
    per_node = pick("workers_per_node", cluster.get("workers_per_node"), WORKERS_PER_NODE)
    link = pick("node_link_gbps", None, GPU_NODE_LINK_GBPS if gpu else CPU_NODE_LINK_GBPS)
    net = pick("network_gbps", None, GPU_NETWORK_GBPS if gpu else CPU_NETWORK_GBPS)
    return Hardware(
        worker_flops=tflops * 1e12, worker_memory=memory * GIB,
        workers_per_node=max(1, int(per_node)), node_link_bw=link * 1e9 / 8,
        network_bw=net * 1e9 / 8, latency_node=10e-6 if gpu else 200e-6,
        latency_network=20e-6 if gpu else 200e-6,
        memory_bw=2e12 if gpu else 10e9, mask_bytes=1 if gpu else 4,
        stage_overhead=0.2e-3 if gpu else 4e-3, use_gpu=gpu, source=source,
        compute_bytes=2 if half else 4,
        reduce_dtype=getattr(cfg, "reduce_dtype", "float32") if half else "float32")


# Dense peak TFLOP/s of one GPU (vendor datasheets, without sparsity), by a piece of
# torch.cuda.get_device_name(): more specific names first; fp32 (raylm leaves TF32 off,
# torch's default) and the 16-bit tensor cores (bf16; fp16 where the GPU has no bf16:
# V100, T4). The denominator of the model FLOPs utilisation (mfu) in the logs.
PEAK_TFLOPS = (  # (name, fp32, bf16/fp16)
    ("H100 PCIe", 51.0, 756.0), ("H100 NVL", 60.0, 835.0), ("H100", 67.0, 989.0),
    ("H200", 67.0, 989.0), ("GH200", 67.0, 989.0), ("B200", 80.0, 2250.0),
    ("A100", 19.5, 312.0), ("A10G", 31.2, 70.0), ("A10", 31.2, 125.0),
    ("L40S", 91.6, 362.0), ("L40", 90.5, 181.0), ("L4", 30.3, 121.0),
    ("V100", 15.7, 125.0), ("T4", 8.1, 65.0),
)


def peak_flops(device_name: str, peak_tflops: float = 0.0, half: bool = False):
    """FLOP/s one rank's device peaks at: ``peak_tflops`` (--peak_tflops) when given,
    else the table's figure for a known GPU name (``half``: its 16-bit tensor cores',
    under --bf16/--fp16), else None (a CPU's peak depends on its vector units and
    clocks, which nothing here reads reliably)."""
    if peak_tflops > 0:
        return peak_tflops * 1e12
    for name, fp32, low in PEAK_TFLOPS:
        if name.lower() in (device_name or "").lower():
            return (low if half else fp32) * 1e12
    return None
