"""A calibrated model of synchronous against asynchronous GRPO, checked against the CPU measurement,
and its prediction for K rollout GPUs against N trainer GPUs.

    python benchmarks/async_model.py      # reads runs/bench_async/results.json and docs/async/gpu.json

A step generates B samples (answers of L_mean tokens on average, L_max at most), trains, syncs weights.
Generation of m samples on one device: T_gen(m) = c0 * L_max + c1 * m * L_mean (c0: a decode
iteration's fixed cost, a GPU's decode is mostly that; c1: one more sample's token, a CPU's decode is
mostly that). Update on D devices: U1 / D + h (h: the data-parallel overhead, D > 1). Weights: w.
Synchronous on G devices: T_gen(B / G) + U1 / G + h + w. K rollout and N = G - K trainer devices at
staleness >= 1, in steady state: max(T_gen(B / K), U1 / N + h + w_send). Streamed (--stream-rollouts),
the engine refills each ended answer's place, so no iteration waits on the longest answer alone:
T_stream(m) = c0 * L_mean + c1 * m * L_mean.
CPU check: each shape's async step from its sync run's phases and the other shape's c1, h, w_send.
GPU: c0, c1, U1 per token and w from one H200 (async_gpu.py), h = 0, GSM8K's measured length tail.
"""

import argparse
import json


def shape_inputs(shape, samples):
    """What a shape's synchronous run on 2 ranks says: B, the lengths, g2 (generation of B/2), U2, w."""
    s = shape["sync"]["summary"]
    lengths = s["lengths"]
    return dict(
        B=samples,
        lmean=lengths["mean"],
        lmax=lengths["max"],
        g2=s["phases"]["gen"],
        U2=s["phases"]["update_actor"],
        w=s["phases"]["update_weights"],
    )


def device_constants(shape, samples):
    """c1, h, w_send from one shape's two runs: the rollout rank generates all B where each sync rank
    made B/2; the trainer updates alone where two shared the batch."""
    s, a = shape["sync"]["summary"]["phases"], shape["async"]["summary"]["phases"]
    lmean = shape["sync"]["summary"]["lengths"]["mean"]
    c1 = (a["gen"] - s["gen"]) / (samples / 2 * lmean)
    h = s["update_actor"] - a["update_actor"] / 2
    return dict(c1=c1, h=h, w_send=a["update_weights"])


def predict_cpu(x, c):
    """(sync on 2, async with 1 rollout + 1 trainer), from the sync run's phases and constants c."""
    U1 = 2 * (x["U2"] - c["h"])
    gen_all = x["g2"] + c["c1"] * (x["B"] / 2) * x["lmean"]  # T_gen(B) from the measured T_gen(B/2)
    return x["g2"] + x["U2"] + x["w"], max(gen_all, U1 + c["w_send"]), gen_all


def check_cpu(results):
    shapes, samples = results["shapes"], {"multiply": 64, "gsm8k": 16}
    names = [n for n in ("multiply", "gsm8k") if n in shapes]
    print(
        f"{'shape':>9} {'constants from':>15} {'c1 ms':>7} {'h s':>6} {'phase':>11} {'predicted s':>12} {'measured s':>11} {'error':>6}"
    )
    for name in names:
        other = next((n for n in names if n != name), name)
        c = device_constants(shapes[other], samples[other])
        x = shape_inputs(shapes[name], samples[name])
        sync, async_, gen_all = predict_cpu(x, c)
        measured = dict(
            sync=shapes[name]["sync"]["summary"]["step_s"], async_=shapes[name]["async"]["summary"]["step_s"]
        )
        measured["gen"] = shapes[name]["async"]["summary"]["phases"]["gen"]
        for label, p, m in (("async gen", gen_all, measured["gen"]), ("async step", async_, measured["async_"])):
            print(
                f"{name:>9} {other:>15} {c['c1'] * 1e3:>7.3f} {c['h']:>6.2f} {label:>11} {p:>12.2f} {m:>11.2f} {100 * (p - m) / m:>5.0f}%"
            )
        print(
            f"{name:>9}: async/sync speedup predicted {sync / async_:.2f}x, measured {measured['sync'] / measured['async_']:.2f}x"
        )
        if "stream" in shapes[name]:  # on CPU c0 is not separated from c1: the stream's prediction is async's
            stream = shapes[name]["stream"]["summary"]["step_s"]
            print(
                f"{name:>9}: stream/sync speedup predicted {sync / async_:.2f}x, measured {measured['sync'] / stream:.2f}x"
            )


def predict_gpu(gpu, tail, samples, prompt_tokens, lmax, h=0.0):
    """Speedup of K rollout GPUs against G synchronous ones, for `samples` answers of the measured tail.
    c0 was measured at the GPU run's answer length; c1 below 0 (noise) counts as 0."""
    c0, c1, w = gpu["c0"], max(gpu["c1"], 0.0), gpu["w"]
    lmean = tail * lmax
    U1 = gpu["u"] * samples * (prompt_tokens + lmean)
    gen = lambda m: c0 * lmax + c1 * m * lmean  # noqa: E731
    gen_stream = lambda m: c0 * lmean + c1 * m * lmean  # noqa: E731
    upd = lambda n: U1 / n + (h if n > 1 else 0.0)  # noqa: E731
    print(
        f"\nOne {gpu['device']} (async_gpu.py): c0 {c0 * 1e3:.1f} ms per decode iteration, c1 {c1 * 1e6:.1f} us per "
        f"sample-token, update {gpu['u'] * 1e6:.1f} us per token, weights {w:.2f} s; {samples} samples of "
        f"{prompt_tokens} + {lmean:.0f} tokens on average ({lmax} at most); h = {h} s"
    )
    print(f"{'G':>3} {'K':>3} {'N':>3} {'sync s':>8} {'async s':>8} {'speedup':>8} {'stream s':>9} {'speedup':>8}")
    for g in (2, 4, 8, 16):
        sync = gen(samples / g) + upd(g) + w
        for k in sorted({1, max(g // 4, 1), g // 2}):
            async_ = max(gen(samples / k), upd(g - k) + w)
            stream = max(gen_stream(samples / k), upd(g - k) + w)
            print(
                f"{g:>3} {k:>3} {g - k:>3} {sync:>8.2f} {async_:>8.2f} {sync / async_:>7.2f}x {stream:>9.2f} {sync / stream:>7.2f}x"
            )


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", default="runs/bench_async/results.json", help="async_throughput.py's output")
    p.add_argument("--gpu", default="docs/async/gpu.json", help="async_gpu.py's output")
    p.add_argument("--samples", type=int, default=512, help="a GPU step's samples (e.g. 64 prompts x 8)")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-response", type=int, default=512, help="L_max: the CPU GSM8K shape's")
    a = p.parse_args()
    results = json.load(open(a.results))
    check_cpu(results)
    gsm8k = results["shapes"]["gsm8k"]["sync"]["summary"]["lengths"]
    predict_gpu(json.load(open(a.gpu)), gsm8k["mean"] / gsm8k["max"], a.samples, a.prompt_tokens, a.max_response)


if __name__ == "__main__":
    main()
