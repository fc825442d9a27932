"""Two ways to reproduce one device's random draws in N towers, against per-tower streams (issue 22).

80 dropout-mask draws of [64, 128] per step (an unrolled LSTM's), each tower summing its rows,
on N logical CPUs, side by side in one process, medians of 15 rounds of 10 steps:

- ``global``: what replicate does: the draw of the global shape once per step with the
  original seeds, cut into the towers' rows by one SplitV;
- ``counter``: each tower draws only its rows with ``StatelessRandomUniformV2``, keyed by the
  op's seed, its counter the stateful kernel's (seed2 in the high word, 256 per element drawn
  so far, plus the tower's first element / 4): bit-for-bit the stateful draw's rows (checked
  below). The per-op state (elements drawn so far) lives in a ``MutableHashTable``, which
  needs no initializer and starts empty in every session as the kernel does;
- ``counter1``: the same with one state for all draws: a lower bound of the counter method,
  valid only when every draw runs in every step;
- ``streams``: each tower its own stream (hand-written towers, MirroredStrategy): not exact.

    python benchmarks/draw_methods.py 2 && python benchmarks/draw_methods.py 4
"""
import sys, time, numpy as np, tensorflow as tf
v1 = tf.compat.v1; raw = tf.raw_ops
v1.disable_eager_execution()
N = int(sys.argv[1]) if len(sys.argv) > 1 else 4
DRAWS, B, H = 80, 64, 128
counts = [B // N + (1 if k < B % N else 0) for k in range(N)]
offs = [sum(counts[:k]) for k in range(N)]
devs = [f"/cpu:{k}" for k in range(N)]

def consume(parts):
    outs = []
    for k, p in enumerate(parts):
        with tf.device(devs[k]):
            outs.append(tf.reduce_sum(p))
    return tf.add_n(outs)

def build(kind):
    g = tf.Graph()
    with g.as_default():
        total = []
        if kind.startswith("counter"):
            with tf.device("/cpu:0"):
                table = raw.MutableHashTableV2(key_dtype=tf.int64, value_dtype=tf.int64, shared_name="", use_node_name_sharing=False)
        for d in range(DRAWS):
            seed, seed2 = 1, 100 + d
            if kind == "global":
                with tf.device("/cpu:0"):
                    full = raw.RandomUniform(shape=[B, H], dtype=tf.float32, seed=seed, seed2=seed2)
                    parts = tf.split(full, counts, 0)
            elif kind == "streams":
                parts = []
                for k in range(N):
                    with tf.device(devs[k]):
                        parts.append(raw.RandomUniform(shape=[counts[k], H], dtype=tf.float32, seed=seed, seed2=seed2 * 10 + k))
            elif kind == "counter1":
                if d == 0:
                    with tf.device("/cpu:0"):
                        state1 = raw.LookupTableFindV2(table_handle=table, keys=tf.constant(0, tf.int64), default_value=tf.constant(0, tf.int64))
                        with tf.control_dependencies([state1]):
                            ins1 = raw.LookupTableInsertV2(table_handle=table, keys=tf.constant(0, tf.int64), values=state1 + B * H * 256)
                        base1 = tf.stack([tf.bitcast(state1, tf.uint64), tf.constant(0, tf.uint64)])
                    bases = []
                    for k in range(N):
                        with tf.device(devs[k]):
                            with tf.control_dependencies([ins1]):
                                bases.append(base1 + tf.constant([offs[k] * H // 4, 0], tf.uint64))
                parts = []
                for k in range(N):
                    with tf.device(devs[k]):
                        parts.append(raw.StatelessRandomUniformV2(shape=[counts[k], H], key=tf.constant([seed], tf.uint64), counter=bases[k] + tf.constant([0, seed2], tf.uint64), alg=1, dtype=tf.float32))
            else:
                with tf.device("/cpu:0"):
                    state = raw.LookupTableFindV2(table_handle=table, keys=tf.constant(d, tf.int64), default_value=tf.constant(0, tf.int64))
                    with tf.control_dependencies([state]):
                        ins = raw.LookupTableInsertV2(table_handle=table, keys=tf.constant(d, tf.int64), values=state + B * H * 256)
                    base = tf.stack([tf.bitcast(state, tf.uint64), tf.constant(seed2, tf.uint64)])
                parts = []
                for k in range(N):
                    with tf.device(devs[k]):
                        counter = base + tf.constant([offs[k] * H // 4, 0], tf.uint64)
                        with tf.control_dependencies([ins]):
                            parts.append(raw.StatelessRandomUniformV2(shape=[counts[k], H], key=tf.constant([seed], tf.uint64), counter=counter, alg=1, dtype=tf.float32))
            total.append(consume(parts))
        out = tf.add_n(total)
    return g, out

cfg = v1.ConfigProto(device_count={"CPU": N})
sessions = {}
for kind in ("global", "counter", "counter1", "streams"):
    g, out = build(kind)
    s = v1.Session(graph=g, config=cfg)
    sessions[kind] = (s, out)
# exactness: counter == global over 3 steps
def steps(kind):
    return [sessions[kind][0].run(sessions[kind][1]) for _ in range(3)]
ga = steps("global")
for kind in ("counter", "counter1"):
    assert np.array_equal(ga, steps(kind)), kind     # the same masks, bit for bit
print(f"exact: counter and counter1 draw the global draw's values over 3 steps ({ga[0]:.2f}, ...)")
for s, out in sessions.values():
    for _ in range(5): s.run(out)
times = {k: [] for k in sessions}
for r in range(15):
    for k, (s, out) in sessions.items():
        t = time.perf_counter()
        for _ in range(10): s.run(out)
        times[k].append((time.perf_counter() - t) / 10)
med = {k: float(np.median(v)) * 1e3 for k, v in times.items()}
print(f"N={N} medians ms:", {k: round(v, 3) for k, v in med.items()},
      "global/streams %.3f counter/streams %.3f counter1/streams %.3f" % (med["global"] / med["streams"], med["counter"] / med["streams"], med["counter1"] / med["streams"]))
