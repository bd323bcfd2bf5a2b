"""A dry run extrapolated from 3 and 4 layers gives the bytes of a dry run of every layer.

``opd plan`` traces a deep model with alike layers at 3 and at 4 layers and extrapolates
each phase of the step to the real depth (:mod:`opd.plan.layer_extrapolation`).
Here a 6-layer student and a 7-layer teacher are dry-run both ways, in the placements
whose memory has the most structure: a colocated sharded teacher with two micro-batches;
activation checkpointing with HSDP, a LoRA student and the teacher's output layer alone; a
whole colocated teacher with the student's layers kept gathered, on the uneven last rank;
and a sharded teacher-pool replica. Every figure (the peak, its breakdown by kind, the
standing memory, the count of collectives, host bytes) must be the same to the byte.

The models' widths are chosen so that, in the colocated case, the peak moves with depth:
at 3 and 4 student layers it is in the teacher's forward (a wide gathered layer), at 7 in
the student's backward. Extrapolating the step's peak as one figure, instead of phase by
phase, gets that case wrong (4% under), and this test fails.

The script runs in a process of its own (a dry run registers a stand-in accelerator for
its process, :mod:`opd.plan.dry_run`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from opd_test_helpers import json_from_a_process_of_its_own

SCRIPT = Path(__file__).with_name("layer_extrapolation_script.py")
CASES = (
    "colocated_two_micro_batches",
    "checkpointing_hsdp_lora_teacher_apart",
    "whole_teacher_uneven_last_rank",
    "replica_sharded_hidden_states",
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return json_from_a_process_of_its_own([str(SCRIPT), str(tmp_path_factory.mktemp("models"))])


@pytest.mark.parametrize("case", CASES)
def test_the_extrapolated_dry_run_equals_the_dry_run_of_every_layer(runs, case):
    every_layer, extrapolated = (runs["results"][case][way] for way in ("every_layer", "extrapolated"))
    # The figures say how they were made: which models were extrapolated, to what depth.
    assert every_layer["memory"].pop("extrapolated_layers") == {}
    depths = extrapolated["memory"].pop("extrapolated_layers")
    assert depths and set(depths.values()) == {7} and set(depths) <= {runs["student"], runs["teacher"]}
    assert extrapolated["memory"] == every_layer["memory"]
    assert every_layer["memory"]["peak"] > 0


@pytest.mark.parametrize("case", CASES)
def test_the_extrapolated_run_traced_no_model_deeper_than_4_layers(runs, case):
    every_layer, extrapolated = (runs["results"][case][way] for way in ("every_layer", "extrapolated"))
    assert every_layer["traced"] == [{}]  # one trace, every model at its full depth
    # A base trace with every deep model at 3 layers, then each model at 4 on its own.
    assert extrapolated["traced"][0] and set(extrapolated["traced"][0].values()) == {3}
    models = list(extrapolated["traced"][0])
    assert len(extrapolated["traced"]) == 1 + len(models)
    for model, depths in zip(models, extrapolated["traced"][1:], strict=True):
        assert depths == {**extrapolated["traced"][0], model: 4}
    colocated = case in ("colocated_two_micro_batches", "whole_teacher_uneven_last_rank")
    if colocated:  # both models are deep: both are cut, and each is deepened on its own
        assert set(models) == {runs["student"], runs["teacher"]}
