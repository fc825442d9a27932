#!/bin/sh
# Between-graph replication on this machine: 2 worker processes, each with its own server and
# client and its own (uneven) batches, all-reducing gradients with TensorFlow's collectives;
# then the sparse case: an embedding table on 1 ps task. Each run prints
#   max rel param diff vs single device: X
# (one device trained on the workers' batches concatenated). launch.py stops every process it
# started on exit, on error, on Ctrl-C (SIGINT) and on SIGTERM.
set -e
cd "$(dirname "$0")"
WORK=${1:-/tmp/replicate_between}
python launch.py --work "$WORK/cnn" --steps 4 --batch 16,8 --size tiny
python launch.py --work "$WORK/sparse" --sparse --steps 4 --batch 12,20
