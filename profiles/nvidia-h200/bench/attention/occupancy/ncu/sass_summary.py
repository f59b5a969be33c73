"""Per-opcode sums of an ncu source page (`ncu -i REP --page source --csv --print-source sass`):
instructions executed, warp-stall samples and their reasons, and the share of all samples.
Usage: python3 sass_summary.py SASS_CSV OUT_CSV"""
import sys

import pandas as pd

df = pd.read_csv(sys.argv[1], skiprows=1)  # the first line names the kernel
df["opcode"] = (df["Source"].str.strip().str.replace(r"^@!?U?P\w+\s+", "", regex=True)
                .str.split().str[0])
stalls = [c for c in df.columns if c.startswith("stall_") and "Not Issued" not in c]
counts = ["Instructions Executed", "Warp Stall Sampling (All Samples)"]
for c in stalls + counts:
    df[c] = pd.to_numeric(df[c], errors="coerce").fillna(0)
by_op = df.groupby("opcode")[counts + stalls].sum()
by_op["sample_share"] = by_op[counts[1]] / by_op[counts[1]].sum()
by_op.sort_values(counts[1], ascending=False).to_csv(sys.argv[2])
reasons = df[stalls].sum()
print("stall reasons, share of all samples:")
print((reasons / reasons.sum()).sort_values(ascending=False).head(10).round(3).to_string())
print("instructions executed:", int(df[counts[0]].sum()))
