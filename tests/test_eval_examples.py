"""Per-process reading of the evaluation examples: batches_lib.RowSelection (the data layer reads and
tokenizes only the selected positions) and evaluation/examples.py (every row's texts and
lengths from every process's part; the tokens only where they were read). The two-process
runs themselves are in test_eval_multihost.py and test_pipeline_mesh.py."""

import jax
import numpy as np
import pytest

from distillspec_jax.data import batches as batches_lib
from distillspec_jax.evaluation import examples as examples_lib
from distillspec_jax.evaluation import quality
from distillspec_jax.models.config import model_config
from distillspec_jax.models.model import Model
from distillspec_jax.training import multihost
from distillspec_jax.training import partitioning


TASK, SPLIT, LENGTHS, COUNT = "embedded_arithmetic", "test", {"inputs": 48, "targets": 48}, 11


@pytest.fixture(scope="module")
def whole():
  return batches_lib.get_prompts_and_targets(TASK, SPLIT, LENGTHS, num_examples=COUNT,
                                      on_long_prompt="truncate")


def _read(selection, lengths=LENGTHS, **kwargs):
  return batches_lib.get_prompts_and_targets(TASK, SPLIT, lengths, num_examples=COUNT,
                                      rows=selection, **dict(dict(on_long_prompt="truncate"),
                                                              **kwargs))


@pytest.mark.parametrize("selection, positions", [
    (batches_lib.RowSelection(4, 1, 3), [1, 2, 5, 6, 9, 10]),
    (batches_lib.RowSelection(4, 2, 4, leading=2), [0, 1, 2, 3, 6, 7, 10]),
    (batches_lib.RowSelection(COUNT, 0, COUNT), list(range(COUNT)))])
def test_row_selection_reads_the_rows_of_the_whole_read(whole, selection, positions):
  part = _read(selection)
  assert part.positions.tolist() == positions and part.complete
  for key in ("prompts", "targets", "prompt_lengths", "target_lengths"):
    np.testing.assert_array_equal(getattr(part, key), getattr(whole, key)[positions],
                                  err_msg=key)
  for key in ("prompt_texts", "target_texts"):
    assert getattr(part, key) == [getattr(whole, key)[i] for i in positions]


def test_a_dropped_row_makes_the_part_incomplete():
  # Prompts of more than 8 tokens are skipped: the rows no longer match the positions.
  part = _read(batches_lib.RowSelection(2, 0, 1), {"inputs": 8, "targets": 48},
               on_long_prompt="skip")
  assert not part.complete and len(part.prompts) < len(part.positions)
  with pytest.raises(ValueError, match="shuffle=False"):
    _read(batches_lib.RowSelection(2, 0, 1), shuffle=True, seed=0)


@pytest.mark.parametrize("start, stop, period", [(2, 2, 4), (-1, 2, 4), (0, 5, 4)])
def test_row_selection_refuses_empty_or_outside_rows(start, stop, period):
  with pytest.raises(ValueError, match=rf"\[{start}, {stop}\) of period {period}"):
    batches_lib.RowSelection(period, start, stop)


def _parts(selections):
  reads = [_read(s) for s in selections]
  parts = [{"complete": r.complete, **{k: getattr(r, k) for k in examples_lib.SHARED_FIELDS}}
           for r in reads]
  return reads, parts


def test_assemble_gives_every_process_every_row(whole):
  # Two processes of a batch of 4 rows: rows 0-1 and 2-3; process 0 also reads the first 3.
  reads, parts = _parts([batches_lib.RowSelection(4, 0, 2, leading=3), batches_lib.RowSelection(4, 2, 4)])
  for mine in reads:
    got = examples_lib.assemble(parts, mine, LENGTHS)
    local = np.isin(np.arange(COUNT), mine.positions)
    np.testing.assert_array_equal(got.local, local)
    for key in ("prompt_texts", "target_texts"):
      assert getattr(got, key) == getattr(whole, key)
    for key in ("prompt_lengths", "target_lengths"):
      np.testing.assert_array_equal(getattr(got, key), getattr(whole, key))
    for key in ("prompts", "targets"):
      np.testing.assert_array_equal(getattr(got, key)[local], getattr(whole, key)[local])
      assert not getattr(got, key)[~local].any()  # another process's rows: never read here


def test_assemble_without_lengths_takes_the_longest_row_of_all_processes(whole):
  reads, parts = _parts([batches_lib.RowSelection(4, 0, 2), batches_lib.RowSelection(4, 2, 4)])
  for mine in reads:
    got = examples_lib.assemble(parts, mine, None)
    assert got.prompts.shape == (COUNT, int(whole.prompt_lengths.max()))
    assert got.targets.shape == (COUNT, int(whole.target_lengths.max()))


def test_assemble_refuses_incomplete_or_uncovered_parts():
  reads, parts = _parts([batches_lib.RowSelection(4, 0, 2), batches_lib.RowSelection(4, 2, 4)])
  assert examples_lib.assemble([dict(parts[0], complete=False), parts[1]], reads[0],
                               LENGTHS) is None
  with pytest.raises(ValueError, match="cover every row"):
    examples_lib.assemble(parts[:1], reads[0], LENGTHS)


def test_one_process_reads_the_whole_split(whole):
  mesh = partitioning.make_mesh(1, 1, devices=jax.devices()[:1])
  got, place = examples_lib.read_examples(TASK, SPLIT, LENGTHS, num_examples=COUNT, mesh=mesh,
                                          batch_size=None, on_long_prompt="truncate")
  assert got.local.all() and place.batch_size == COUNT
  np.testing.assert_array_equal(got.prompts, whole.prompts)
  assert multihost.all_gather_objects({"a": [1]}) == [{"a": [1]}]


@pytest.mark.slow
def test_batched_quality_equals_one_batch():
  model = Model(model_config("tiny_encoder_decoder", num_decoder_layers=1, vocab_size=64,
                             max_decode_length=16))
  params = model.init(jax.random.PRNGKey(0))
  prompts = np.random.default_rng(0).integers(2, 64, (5, 6)).astype(np.int32)
  targets = np.random.default_rng(1).integers(2, 64, (5, 4)).astype(np.int32)
  detokenize = lambda ids: " ".join(map(str, ids))
  metric = lambda references, predictions: {"n": float(len(predictions))}
  one = quality.quality(model, params, prompts, targets, ["x"] * 5, 5, detokenize, metric)
  # Two batches of 3, the second padded with one-token prompts that count nowhere.
  batched = quality.quality(model, params, prompts, targets, ["x"] * 5, 5, detokenize, metric,
                            batch_size=3)
  assert batched["example_prediction"] == one["example_prediction"] and batched["n"] == 5.0
  assert batched["per_token_loss"] == pytest.approx(one["per_token_loss"], rel=1e-5)
  assert quality.greedy_predictions(model, params, prompts, 5, detokenize, batch_size=2) == (
      quality.greedy_predictions(model, params, prompts, 5, detokenize))


def test_assemble_pads_with_the_readers_pad_not_token_0():
  # A Hugging Face tokenizer's rows (0 is "!", a real token; padding is NO_TOKEN): process 0
  # read row 0 (2 tokens, its own width 2), process 1 row 1 (4 tokens).
  from distillspec_jax.models.model import NO_TOKEN

  def read(position, prompt):
    prompt = np.asarray([prompt], np.int32)
    return batches_lib.Examples(prompt, np.asarray([prompt.shape[1]], np.int32), prompt,
                                np.asarray([prompt.shape[1]], np.int32), ["p"], ["t"],
                                positions=np.asarray([position]), pad=NO_TOKEN)

  reads = [read(0, [0, 7]), read(1, [0, 5, 0, 9])]
  parts = [{"complete": True, **{k: getattr(r, k) for k in examples_lib.SHARED_FIELDS}}
           for r in reads]
  got = examples_lib.assemble(parts, reads[0], None)
  for key in ("prompts", "targets"):
    np.testing.assert_array_equal(getattr(got, key), [[0, 7, NO_TOKEN, NO_TOKEN],
                                                      [NO_TOKEN] * 4])
  assert got.pad == NO_TOKEN
  got = examples_lib.assemble(parts, reads[1], {"inputs": 6, "targets": 5})
  np.testing.assert_array_equal(got.prompts, [[NO_TOKEN] * 6, [0, 5, 0, 9, NO_TOKEN, NO_TOKEN]])
