"""Triton kernels for the CUDA path, each beside a torch reference.

The kernel modules import triton at their top, so import them only where CUDA — or
the Triton interpreter (`TRITON_INTERPRET=1`, set before triton is first imported) —
is in use; `import pagoda.kernels`, `attention_metadata`, `reference` and `testing`
stay free of triton. The kernels import only torch, triton, numpy and each other: the
library calls into them, never the reverse (`tests/test_import_rules.py`).

- `kv_cache.write_kv_cache`        KV-cache write by slot mapping
- `attention.paged_attention`      decode (split-K) + prefill/chunked-prefill over paged KV
- `rms_norm.rms_norm`              RMSNorm, optionally fused with the residual add
- `rotary.rotary_embedding`        rotary position embedding (NeoX or GPT-J layout)
- `activation.silu_and_mul`        SiLU(gate) * up
- `quant_matmul.int4_matmul`, `fp8_matmul`  GEMMs that dequantize int4 / fp8 weight tiles
- `fused_moe.fused_experts`        MoE experts as grouped GEMMs over pairs sorted by expert
- `attention_metadata`             the step's attention inputs (the library builds them)
- `reference`                      the torch oracles the tests compare against
- `testing`                        random paged batches and interpreter fixes for the
                                   tests and benchmarks/gpu_check.py

The launchers take the same arguments as the torch path in `pagoda.model`, so
`pagoda.model.ops` switches between them on the tensors' device alone.
"""
