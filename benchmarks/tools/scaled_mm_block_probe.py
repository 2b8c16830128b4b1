"""Which block each scale of torch._scaled_mm's DeepSeek-style block scaling multiplies (1 x 128
activation scales, 128 x 128 weight scales), found by raising one scale at a time and matching the
product's change against every block's own contribution. CUDA (Hopper) only.

    PYTHONPATH=. python benchmarks/tools/scaled_mm_block_probe.py OUT_JSON

For the weight's scale [N / 128, K / 128] (passed as `scale.t()`, the layout torch checks) and
the activations' [M, K / 128] (column-major), it prints, per raised entry, the block whose
contribution the change equals (or "none"), and whether the identity mapping held. Several
shapes, so a transposed or flattened reading shows up as a permutation.
"""

from __future__ import annotations

import json
import sys

import torch


def _contribution(xq, sa, wq, i, j, rows=None):
    """(x block-column j times its act scales) @ (W block (i, j))^T, placed in output block i."""
    m = xq.shape[0]
    out = torch.zeros(m, wq.shape[0], device=xq.device)
    xs = xq[:, j * 128:(j + 1) * 128].float() * sa[:, j:j + 1]
    if rows is not None:
        mask = torch.zeros(m, 1, device=xq.device)
        mask[rows] = 1
        xs = xs * mask
    block = wq[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].float()
    out[:, i * 128:(i + 1) * 128] = xs @ block.t()
    return out


def probe(m: int, n: int, k: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    wq = torch.randn(n, k, device="cuda", generator=g).clamp(-4, 4).to(torch.float8_e4m3fn)
    xq = torch.randn(m, k, device="cuda", generator=g).clamp(-4, 4).to(torch.float8_e4m3fn)
    nb, kb = n // 128, k // 128
    sw = torch.ones(nb, kb, device="cuda")
    sa_store = torch.empty(kb, m, device="cuda")  # column-major [M, K / 128]

    def run(sw, sa):
        sa_store.copy_(sa.t())
        return torch._scaled_mm(xq, wq.t(), scale_a=sa_store.t(), scale_b=sw.t(),
                                out_dtype=torch.float32)

    sa1 = torch.ones(m, kb, device="cuda")
    base = run(sw, sa1)
    ref = xq.float() @ wq.float().t()
    result = {"m": m, "n": n, "k": k, "base_rel_err": float((base - ref).norm() / ref.norm()),
              "weight": [], "act": []}
    contribs = {(i, j): _contribution(xq, sa1, wq, i, j) for i in range(nb) for j in range(kb)}
    for i in range(nb):
        for j in range(kb):
            s = sw.clone()
            s[i, j] = 3.0
            delta = run(s, sa1) - base
            found = "none"
            for (a, b), c in contribs.items():
                if ((delta - 2.0 * c).norm() / (2.0 * c).norm()) < 2e-2:
                    found = [a, b]
                    break
            result["weight"].append({"raised": [i, j], "acts_on": found})
    for r in (0, m - 1):
        for j in range(kb):
            s = sa1.clone()
            s[r, j] = 3.0
            delta = run(sw, s) - base
            found = "none"
            for rr in range(m):
                for jj in range(kb):
                    c = sum(_contribution(xq, sa1, wq, i, jj, rows=[rr]) for i in range(nb))
                    if c.norm() > 0 and ((delta - 2.0 * c).norm() / (2.0 * c).norm()) < 2e-2:
                        found = [rr, jj]
                        break
                if found != "none":
                    break
            result["act"].append({"raised": [r, j], "acts_on": found})
    result["weight_identity"] = all(e["acts_on"] == e["raised"] for e in result["weight"])
    result["act_identity"] = all(e["acts_on"] == e["raised"] for e in result["act"])
    return result


def main() -> None:
    out = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "shapes": []}
    for m, n, k in ((128, 256, 512), (64, 512, 256), (256, 384, 384)):
        try:
            r = probe(m, n, k)
        except RuntimeError as e:
            r = {"m": m, "n": n, "k": k, "error": str(e)[:300]}
        out["shapes"].append(r)
        print(json.dumps({key: v for key, v in r.items() if key not in ("weight", "act")}),
              flush=True)
        for key in ("weight", "act"):
            wrong = [e for e in r.get(key, []) if e["acts_on"] != e["raised"]]
            print(key, "wrong:", wrong[:12], flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
