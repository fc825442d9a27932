#!/bin/sh
# The seeds' MNIST CNN on a local TensorFlow cluster (1 ps + 2 workers), in-graph replication;
# then a worker is killed mid-training and the run recovers from its last checkpoint.
set -e
cd "$(dirname "$0")"
WORK=${1:-/tmp/replicate_distributed}
mkdir -p "$WORK"
rm -rf "$WORK/cluster.json" "$WORK/ckpt"

# 1. Start the servers (loopback only) and wait for the spec; stop them on exit.
replicate cluster --ps 1 --workers 2 --json "$WORK/cluster.json" --restart > "$WORK/cluster.log" 2>&1 &
CLUSTER=$!
trap 'kill $CLUSTER 2>/dev/null; wait $CLUSTER 2>/dev/null' EXIT
while [ ! -f "$WORK/cluster.json" ]; do
    kill -0 $CLUSTER 2>/dev/null || { cat "$WORK/cluster.log"; exit 1; }
    sleep 1
done
cat "$WORK/cluster.log"

# 2. Towers on the worker tasks, variables on the ps task; one client session on worker 0.
#    Compared with single-device training on the same global batches.
python train.py --cluster "$WORK/cluster.json" --steps 20

# 3. The same with MonitoredTrainingSession and checkpoints every 3 steps; --local starts a
#    cluster of its own so that the script can kill worker 1 after step 7 and restart it.
python train.py --local --size small --steps 12 --checkpoint-dir "$WORK/ckpt" --save-steps 3 --kill-at 7

# 4. A driver that died resumes from the newest checkpoint: run it again on the same directory.
python train.py --cluster "$WORK/cluster.json" --size small --steps 12 --checkpoint-dir "$WORK/ckpt"
