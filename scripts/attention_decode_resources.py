"""The attention decode split kernel's resources on sm_90 without a GPU: compiled by Triton for
GPUTarget("cuda", 90, 32) at Qwen3-Next's shapes (head_dim 256, a KV head's 8 query heads padded to 16, bf16, page
16), one line per (int32 offsets or not, keys a step, warps, stages): registers, spill stack
(cuobjdump -res-usage, Triton's own) and the shared memory Triton asks for. Where the stages change no shared
memory, Triton's pipeliner has not multi-buffered the loop's loads.

    python3 scripts/attention_decode_resources.py [--off32 0,1] [--block_n 16,32,64] [--warps 4,8] [--stages 2,3]
"""
from __future__ import annotations

import argparse
import itertools

import torch
from _sm90 import compile_sm90

from ktrans.kernels.triton import attention as tri

SIGNATURE = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "BT": "*i64", "LENS": "*i64", "OP": "*fp32", "LSE": "*fp32",
             "qk_scale": "fp32", "stride_qb": "i32", "stride_qh": "i32", "stride_kr": "i32", "stride_kh": "i32",
             "stride_bt": "i32", "split_tokens": "i32", "TUNE": "i32"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("off32", "0,1"), ("block_n", "16,32,64"), ("warps", "4,8"), ("stages", "2,3")):
        ap.add_argument(f"--{name}", default=default)
    args = ap.parse_args()
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    fn = tri._decode_split_kernel
    for off32, block_n, warps, stages in itertools.product(ints(args.off32), ints(args.block_n), ints(args.warps),
                                                           ints(args.stages)):
        consts = {"PAGE": 16, "GROUP": 8, "GROUP_PAD": 16, "D": 256, "BLOCK_D": 256,
                  "PREC": tri._prec(torch.bfloat16), "BLOCK_N": block_n, "OFF32": bool(off32),
                  "PDL": False}
        tag = f"off32={off32} BLOCK_N={block_n} warps={warps} stages={stages}"
        try:
            k, usage = compile_sm90(fn, SIGNATURE, consts, warps, stages)
        except Exception as exc:  # noqa: BLE001  (a shape that does not compile is reported)
            print(f"{tag}: {type(exc).__name__}: {str(exc)[:160]}")
            continue
        print(f"{tag}: {usage} shared={k.metadata.shared}")


if __name__ == "__main__":
    main()
