"""How close a kernel's output must be to the float32 reference to count as verified: one
place for the workbench, the tuner and the benchmark scripts, so a timing never rests on a
looser check in one path than in another. Each value says why it is what it is."""

from __future__ import annotations

# Fraction of FP8 codes the Triton interpreter may get wrong: its fp32 -> e4m3 cast drops the
# rounding carry into the exponent and does not saturate (triton-lang/triton #8322). Only
# for CPU (functional) runs; on a GPU, FP8 codes and scales must match bit for bit.
INTERPRETER_FP8_MISMATCH = 0.08

# Fraction of compressed index codes that may differ from the reference on a GPU: keys pass
# through sin/cos, whose last bits differ between devices and libraries, and a 1-ulp change of
# a key may move its code by one quantization step.
CODE_MISMATCH = 0.01

# Scorers (workbench verification): bf16 queries and MMA operands against the FP32 reference.
SCORE_ATOL = SCORE_RTOL = 3e-2

# Sparse GQA (workbench verification): P rounded to bf16 (fp16 for FP8 tiles) before PV and a
# bf16 output.
ATTENTION_ATOL = ATTENTION_RTOL = 2e-2
