#!/bin/sh
# Between-graph replication on this machine: 2 worker processes, each with its own server and
# client and its own (uneven) batches, all-reducing gradients with TensorFlow's collectives;
# then the sparse case: an embedding table on 1 ps task. Each run prints
#   max rel param diff vs single device: X
# (one device trained on the workers' batches concatenated). The third run is a fault drill:
# worker 1 dies after step 4 of 6 and only it is started again (the chief restarts itself, both
# resume from the step-3 checkpoint); it must still match one device. launch.py stops every
# process it started on exit, on error, on Ctrl-C (SIGINT) and on SIGTERM.
set -e
cd "$(dirname "$0")"
WORK=${1:-/tmp/replicate_between}
python launch.py --work "$WORK/cnn" --steps 4 --batch 16,8 --size tiny
python launch.py --work "$WORK/sparse" --sparse --steps 4 --batch 12,20
python launch.py --work "$WORK/lose" --steps 6 --batch 16,8 --lose-worker 1 --lose-after 4 --save-steps 3
