"""The mechanisms that carry a plan out on a rank: gradient sync, tensor and pipeline parallelism, ZeRO, clipping, compile."""
