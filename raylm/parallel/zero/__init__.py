"""ZeRO over the data-parallel groups (Rajbhandari et al. 2020).

* stage 1 and 2: raylm.parallel.zero.partitioned (raylm's partitioned AdamW and
  reduce-scatter of gradients into each rank's rows);
* stage 3: raylm.parallel.zero.fsdp (torch's FSDP2).

Which rows a rank owns: raylm.plan.zero.
"""
