"""``mechmon scan``: the monitors over a run's saved checkpoints, without training.

The QK-update spectra, the router-weight geometry and the update ratios are functions of the
weights alone, so they can be computed between consecutive checkpoints of a finished (or
failed) run::

    find_checkpoints(RUN_DIR)          torch_dist, Megatron-LM legacy mp_rank_XX, DeepSpeed,
         |                             plain torch state dicts; step order
    safe readers                       weights only: torch.load(weights_only=True), an allow-list
         |                             unpickler for the distributed-checkpoint metadata
    per pair (t0, t1), per layer:      Q/K rows by the live layouts -> the live QK monitor
         |                             router rows -> router_weights.router_weight_stats
         |                             every tensor -> update ratios per weight group
    replay(DetectorBank)               the shipped detectors, baseline from the first pairs
         |
    publish(scan.jsonl, scan.md, scan.png)   atomically, only after everything succeeded

Modules: :mod:`~mechmon_megatron.scan.discover`, :mod:`~mechmon_megatron.scan.safe_load`,
:mod:`~mechmon_megatron.scan.dist_reader`, :mod:`~mechmon_megatron.scan.torch_reader`,
:mod:`~mechmon_megatron.scan.model_spec`, :mod:`~mechmon_megatron.scan.qk_rows`,
:mod:`~mechmon_megatron.scan.plan`, :mod:`~mechmon_megatron.scan.pair`,
:mod:`~mechmon_megatron.scan.replay`, :mod:`~mechmon_megatron.scan.report`,
:mod:`~mechmon_megatron.scan.output`, :mod:`~mechmon_megatron.scan.runner`.
"""

from mechmon_megatron.scan.errors import ScanError
from mechmon_megatron.scan.runner import SCAN_FILES, ScanResult, scan

__all__ = ["SCAN_FILES", "ScanError", "ScanResult", "scan"]
