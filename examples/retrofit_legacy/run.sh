#!/bin/sh
# Retrofit a legacy model: train on one device, convert, continue on four, compare.
set -e
cd "$(dirname "$0")"
WORK=${1:-/tmp/retrofit_legacy}

# 1. The legacy script, as it always ran: one device, saves model.meta and a checkpoint.
python legacy_train.py --out "$WORK" --steps 20
CKPT="$WORK/ckpt/model-20"

# 2. See what replicate finds, then convert (use /gpu:0,...,/gpu:3 on a GPU machine).
replicate inspect "$WORK/model.meta" --devices /cpu:0,/cpu:1,/cpu:2,/cpu:3
replicate convert "$WORK/model.meta" -o "$WORK/model_x4.meta" \
    --devices /cpu:0,/cpu:1,/cpu:2,/cpu:3 --force

# 3. The unchanged driver continues training: on one device, then on four.
python driver.py "$WORK/model.meta" "$CKPT" --data "$WORK/data.npz" --steps 10 --batch 100 \
    --save "$WORK/one/model"
python driver.py "$WORK/model_x4.meta" "$CKPT" --data "$WORK/data.npz" --steps 10 --batch 100 \
    --save "$WORK/four/model"
python compare.py "$WORK/one/model" "$WORK/four/model"

# 4. Checkpoints move both ways: the four-tower checkpoint continues on one device.
python driver.py "$WORK/model.meta" "$WORK/four/model" --data "$WORK/data.npz" --steps 2 \
    --save "$WORK/back/model"
