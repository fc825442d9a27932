"""The transform's options: one frozen record, validated once, recorded where it ran."""

import dataclasses
import json

import models
import pytest

import replicate
from replicate.errors import ReplicateError
from replicate.options import COLLECTION, Options

DEVICES = ["/cpu:0", "/cpu:1"]


def test_options_are_frozen_and_validated_when_built():
    options = Options(aggregation="packed", accumulate=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.accumulate = 3
    for bad, words in (({"aggregation": "sum"}, "aggregation='sum' is not one of add_n"),
                       ({"batch_norm": "global"}, "batch_norm='global' is not one of tower0, sync"),
                       ({"accumulate": 0}, "accumulate=0: give a whole number"),
                       ({"accumulate": True}, "accumulate=True"),
                       ({"param_devices": "everywhere"}, "param_devices='everywhere'"),
                       ({"between_graph": True, "accumulate": 2}, "not supported yet"),
                       ({"train_op": 3}, "train_op=3: give a name"),
                       ({"check": "no"}, "check='no': give True or False")):
        with pytest.raises(ReplicateError, match=words):
            Options(**bad)


def test_a_misspelt_option_is_named_with_the_options_there_are():
    with pytest.raises(ReplicateError, match=r"unknown option acumulate; the options are .*accumulate"):
        Options.build(acumulate=2)
    with pytest.raises(ReplicateError, match="unknown option acumulate"):
        replicate.transform(models.mlp("sgd").graph, DEVICES, acumulate=2)


def test_names_and_mirrored_are_normalized():
    assert Options(outputs="acc:0").outputs == ("acc:0",)
    assert Options(param_devices=["mirrored"]).mirrored
    assert Options(param_devices=["/cpu:1"]).param_devices == ("/cpu:1",)


def test_the_report_the_result_and_the_metagraph_record_the_options():
    res = replicate.transform(models.mlp("sgd").graph, DEVICES, aggregation="packed", accumulate=2,
                              progress=lambda *_: None)
    assert res.options.aggregation == "packed" and res.options.accumulate == 2
    assert res.report.options["aggregation"] == "packed"
    assert "progress" not in res.report.options
    assert json.loads(json.dumps(res.report.to_dict()))["options"]["accumulate"] == 2
    recorded = json.loads(res.meta_graph_def.collection_def[COLLECTION].bytes_list.value[0])
    assert recorded == res.report.options


def test_an_options_object_and_keywords_give_the_same_rewrite():
    graph = models.mlp("sgd").graph
    by_keywords = replicate.transform(graph, DEVICES, aggregation="packed")
    by_object = replicate.transform(graph, DEVICES, Options(aggregation="add_n"), aggregation="packed")
    assert by_object.options == by_keywords.options
    assert by_object.graph_def == by_keywords.graph_def
