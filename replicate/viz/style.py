"""Colours of the picture: one per device, the controller's grey-blue first."""

from __future__ import annotations

import collections
import logging

import networkx as nx

__all__ = ["CONTROLLER_COLOUR", "DEVICE_COLOURS", "NO_DEVICE_COLOUR", "short_device", "palette",
           "tint", "shade", "fill"]

log = logging.getLogger(__name__)

#: Fill of the controller's boxes, then one colour per further device (ColorBrewer Set3).
CONTROLLER_COLOUR = "#d4dce8"
DEVICE_COLOURS = ("#8dd3c7", "#fdb462", "#bebada", "#fb8072", "#b3de69", "#fccde5", "#80b1d3",
                  "#ffed6f", "#bc80bd", "#ccebc5", "#ffffb3", "#d9d9d9")
NO_DEVICE_COLOUR = "#ffffff"


def short_device(device: str) -> str:
    """``/device:GPU:0`` as ``/gpu:0``; other spellings unchanged, '' as ``(no device)``."""
    if not device:
        return "(no device)"
    if device.startswith("/device:") and device.count(":") == 2:
        kind, index = device[len("/device:"):].split(":")
        return f"/{kind.lower()}:{index}"
    return device


def palette(graph: nx.DiGraph, controller: str | None = None) -> dict[str, str]:
    """A fill colour per device of ``graph``: the controller first, then towers in order."""
    totals: collections.Counter = collections.Counter()
    tower_devices: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    index = {g.key: g.index for g in graph.graph.get("groups", [])}
    for _, attrs in graph.nodes(data=True):
        totals.update(attrs["devices"])
        if attrs["kind"] == "tower":
            tower_devices[index[attrs["group"]]].update(attrs["devices"])
    if controller is None:
        shared = collections.Counter()
        for _, attrs in graph.nodes(data=True):
            if attrs["kind"] != "tower":
                shared.update(attrs["devices"])
        controller = shared.most_common(1)[0][0] if shared else None
    order = [controller] if controller in totals else []
    for k in sorted(tower_devices):
        top = tower_devices[k].most_common(1)[0][0]
        if top not in order:
            order.append(top)
    order += sorted(d for d in totals if d not in order)
    colours, spare = {}, iter(DEVICE_COLOURS * (1 + len(order) // len(DEVICE_COLOURS)))
    for device in order:
        if not device:
            colours[device] = NO_DEVICE_COLOUR
        elif device == controller:
            colours[device] = CONTROLLER_COLOUR
        else:
            colours[device] = next(spare)
    return colours


def tint(colour: str, amount: float = 0.75) -> str:
    """``colour`` blended towards white by ``amount``."""
    rgb = [int(colour[i:i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c + (255 - c) * amount):02x}" for c in rgb)


def shade(colour: str, amount: float = 0.45) -> str:
    """``colour`` blended towards black by ``amount``."""
    rgb = [int(colour[i:i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c * (1 - amount)):02x}" for c in rgb)


def fill(devices: collections.Counter, colours: dict[str, str]) -> dict[str, str]:
    """Node style attributes: one fill, or stripes in proportion to each device's ops."""
    total = sum(devices.values())
    parts = [(colours[d], n / total) for d, n in devices.most_common() if n / total >= 0.02]
    if len(parts) == 1:
        return {"style": "filled", "fillcolor": parts[0][0]}
    stripes = ":".join(f"{c};{f:.3f}" for c, f in parts)
    return {"style": "striped", "fillcolor": stripes}
