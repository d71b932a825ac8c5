"""A calibrated model of synchronous against asynchronous GRPO, and its predictions.

    python benchmarks/async_model.py                                  # reads runs/bench_async/results.json
    python benchmarks/async_model.py --gpu runs/bench_async/gpu.json  # and predicts GPUs from a GPU's costs

One step generates B samples, trains on them and syncs the weights. The model's costs, per device:
  generation  T_gen(m) = c0 * L_max + c1 * m * L_mean   for m samples: c0 is a decode iteration's fixed
              cost (what a GPU's memory-bound decode is made of: it waits for the longest answer), c1 the
              cost of each generated token (what a CPU's compute-bound decode is made of)
  update      T_upd(N) = u * tokens / (N * e)   on N devices with data-parallel efficiency e (e = 1 on one)
  weights     w (colocated: into the engine; across ranks: the send)
Synchronous on G devices, each generating B/G and training on B/G:  T_gen(B/G) + T_upd(G) + w.
K rollout devices and N = G - K trainers at staleness >= 1, in steady state: max(T_gen(B/K), T_upd(N) + w).

On the CPU: c0, c1 come from the multiply shape's two generation times (B/2 samples a rank in sync, B on
the rollout rank in async), u and e from its two update times; the model then predicts the gsm8k shape's
step times from its lengths and tokens alone, and prints them against the measurement. With --gpu, c0,
c1, u come from a GPU's measurement (async_gpu.py) and it predicts the speedup of K rollout GPUs against
N trainer GPUs for B samples of the measured length distribution.
"""

import argparse
import json


def calibrate(shape):
    """c0, c1 (s), u (s per token on one device), e, w_sync, w_send from one shape's sync and async runs."""
    s, a = shape["sync"]["summary"], shape["async"]["summary"]
    b, lm = shape["samples"], (s["lengths"]["mean"] + a["lengths"]["mean"]) / 2
    lx = (s["lengths"]["max"] + a["lengths"]["max"]) / 2
    g_half, g_full = s["phases"]["gen"], a["phases"]["gen"]
    c1 = max(g_full - g_half, 0.0) / (b / 2 * lm)
    c0 = max(g_half - c1 * b / 2 * lm, 0.0) / lx
    u = a["phases"]["update_actor"] / shape["tokens"]  # one trainer rank: the whole batch
    e = a["phases"]["update_actor"] / (2 * s["phases"]["update_actor"])
    return dict(c0=c0, c1=c1, u=u, e=e, w_sync=s["phases"]["update_weights"], w_send=a["phases"]["update_weights"])


def gen_time(m, lmean, lmax, c):
    return c["c0"] * lmax + c["c1"] * m * lmean


def predict(c, *, b, lmean, lmax, tokens, g, k):
    """(sync step on g devices, async step with k rollout and g - k trainer devices), seconds."""
    eff = lambda n: 1.0 if n == 1 else c["e"]  # noqa: E731
    sync = gen_time(b / g, lmean, lmax, c) + c["u"] * tokens / (g * eff(g)) + c["w_sync"]
    n = g - k
    async_ = max(gen_time(b / k, lmean, lmax, c), c["u"] * tokens / (n * eff(n)) + c["w_send"])
    return sync, async_


def check_cpu(results):
    """Calibrate on multiply, predict gsm8k, print both against the measurement."""
    shapes = results["shapes"]
    for name, shape in shapes.items():  # what calibrate needs
        shape["samples"] = 64 if name == "multiply" else 16
        shape["tokens"] = shape["async"]["summary"]["tokens_per_s"] * shape["async"]["summary"]["step_s"]
    c = calibrate(shapes["multiply"])
    print("calibrated on multiply: " + ", ".join(f"{k} {v:.4g}" for k, v in c.items()))
    print(f"\n{'shape':>9} {'system':>6} {'predicted s':>12} {'measured s':>11} {'error':>6}")
    for name, shape in shapes.items():
        lm = shape["async"]["summary"]["lengths"]["mean"]
        lx = shape["async"]["summary"]["lengths"]["max"]
        sync, async_ = predict(c, b=shape["samples"], lmean=lm, lmax=lx, tokens=shape["tokens"], g=2, k=1)
        for system, p in (("sync", sync), ("async", async_)):
            m = shape[system]["summary"]["step_s"]
            print(f"{name:>9} {system:>6} {p:>12.2f} {m:>11.2f} {100 * (p - m) / m:>5.0f}%")
        print(
            f"{name:>9} predicted async/sync speedup {sync / async_:.2f}x, measured "
            f"{shape['sync']['summary']['step_s'] / shape['async']['summary']['step_s']:.2f}x"
        )
    return c


def gpu_table(gpu, lmean_over_lmax):
    """Predicted speedup of async (K rollout GPUs) over sync on G = K + N GPUs, for a step whose
    synchronous generation takes a share of the step from 20% to 80%."""
    c = dict(c0=gpu["c0"], c1=gpu["c1"], u=gpu["u"], e=gpu.get("e", 0.9), w_sync=gpu["w"], w_send=gpu["w"])
    b, lmax = gpu.get("samples", 512), gpu.get("lmax", 1024)
    lmean = lmean_over_lmax * lmax
    print(
        f"\nGPU costs: c0 {c['c0'] * 1e3:.2f} ms per decode iteration, c1 {c['c1'] * 1e6:.2f} us per token, "
        f"update {c['u'] * 1e6:.2f} us per token on one GPU, e {c['e']}, weights {c['w_sync']:.2f} s"
    )
    print(f"{b} samples, answers {lmean:.0f} tokens on average and {lmax} at most")
    print(f"{'G':>3} {'K':>3} {'N':>3} {'sync s':>8} {'async s':>8} {'speedup':>8}")
    for g in (2, 4, 8, 16):
        tokens = b * (lmean + gpu.get("prompt", 256))
        for k in sorted({1, g // 4 or 1, g // 2}):
            if k >= g:
                continue
            sync, async_ = predict(c, b=b, lmean=lmean, lmax=lmax, tokens=tokens, g=g, k=k)
            print(f"{g:>3} {k:>3} {g - k:>3} {sync:>8.1f} {async_:>8.1f} {sync / async_:>7.2f}x")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", default="runs/bench_async/results.json", help="async_throughput.py's output")
    p.add_argument("--gpu", default="", help="async_gpu.py's output: a GPU's c0, c1, u, w")
    a = p.parse_args()
    results = json.load(open(a.results))
    check_cpu(results)
    gsm8k = results["shapes"].get("gsm8k")
    if a.gpu:
        ratio = (
            gsm8k["async"]["summary"]["lengths"]["mean"] / gsm8k["async"]["summary"]["lengths"]["max"] if gsm8k else 0.5
        )
        gpu_table(json.load(open(a.gpu)), ratio)


if __name__ == "__main__":
    main()
