"""Plain decoding: greedy follows the full forward's argmax, stops at EOS, is deterministic;
sampling is reproducible per key; requests that do not fit the cache are rejected."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distillspec_jax.core import validation
from distillspec_jax.decoding import plain
from distillspec_jax.decoding.plain import SamplingConfig
from distillspec_jax.models.model import DECODER_START_ID, EOS_ID, PAD_ID, Model


MODEL_NAMES = ("tiny_encoder_decoder", "tiny_decoder_only")
MAX_NEW = 12
NEVER_STOP = SamplingConfig(eos_id=-1)  # greedy, no token ever ends a row


@functools.lru_cache(maxsize=None)
def model_and_params(name):
  model = Model.from_name(name)
  return model, jax.jit(model.init)(jax.random.PRNGKey(0))


def inputs_for(model, seed=0):
  """Keyword inputs of `decode`: padded encoder inputs or right-padded decoder prompts."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(2, model.config.vocab_size, (4, 6)).astype(np.int32)
  for b, n in enumerate((6, 2, 4, 1)):
    tokens[b, n:] = PAD_ID
  key = "encoder_input_tokens" if model.is_encoder_decoder else "prompt_tokens"
  return {key: jnp.asarray(tokens)}


def run(model, params, inputs, **kwargs):
  kwargs.setdefault("max_new_tokens", MAX_NEW)
  result = plain.decode(model, params, **inputs, **kwargs)
  return np.asarray(result.tokens), np.asarray(result.lengths)


def swap_ids(tree_or_tokens, a, b):
  """Relabels token ids a <-> b in a token array."""
  x = np.asarray(tree_or_tokens).copy()
  ia, ib = x == a, x == b
  x[ia], x[ib] = b, a
  return x


def relabel_params(params, a, b):
  """The same network with token ids a and b exchanged (embedding rows, logits columns)."""
  params = jax.tree.map(lambda x: x, params)  # new containers, shared leaves
  emb = np.asarray(params["token_embedder"]["embedding"]).copy()
  emb[[a, b]] = emb[[b, a]]
  kernel = np.asarray(params["decoder"]["logits_dense"]["kernel"]).copy()
  kernel[:, [a, b]] = kernel[:, [b, a]]
  params["token_embedder"]["embedding"] = jnp.asarray(emb)
  params["decoder"]["logits_dense"]["kernel"] = jnp.asarray(kernel)
  return params


@pytest.fixture(scope="module", params=MODEL_NAMES)
def setup(request):
  model, params = model_and_params(request.param)
  inputs = inputs_for(model)
  greedy = run(model, params, inputs, sampling=NEVER_STOP)
  return model, params, inputs, greedy


@pytest.mark.slow
def test_greedy_is_argmax_of_full_forward(setup):
  """Teacher-forcing the model on its own greedy output: each token is the argmax there."""
  model, params, inputs, (tokens, lengths) = setup
  np.testing.assert_array_equal(lengths, [MAX_NEW] * 4)
  if model.is_encoder_decoder:
    prompts = [[DECODER_START_ID]] * 4
  else:
    p = np.asarray(inputs["prompt_tokens"])
    prompts = [[DECODER_START_ID] + [t for t in row if t != PAD_ID] for row in p]
  width = max(len(p) for p in prompts) + MAX_NEW
  seqs = np.zeros((4, width), np.int32)
  for b, p in enumerate(prompts):
    seqs[b, :len(p) + MAX_NEW] = p + list(tokens[b])
  batch = {"decoder_input_tokens": jnp.asarray(seqs)}
  if model.is_encoder_decoder:
    batch["encoder_input_tokens"] = inputs["encoder_input_tokens"]
  logits = np.asarray(jax.jit(model.logits)(params, batch))
  for b, p in enumerate(prompts):
    # The token at step i is predicted from position len(prompt) - 1 + i.
    predicted = logits[b, len(p) - 1:len(p) - 1 + MAX_NEW].argmax(-1)
    np.testing.assert_array_equal(tokens[b], predicted, err_msg=f"row {b}")


def test_greedy_is_deterministic(setup):
  model, params, inputs, (tokens, lengths) = setup
  again, again_lengths = run(model, params, inputs, sampling=NEVER_STOP,
                             rng=jax.random.PRNGKey(123))  # the key is unused when greedy
  np.testing.assert_array_equal(again, tokens)
  np.testing.assert_array_equal(again_lengths, lengths)


@pytest.mark.slow
def test_greedy_stops_at_eos(setup):
  """Relabel a token the model emits as EOS: rows must stop right there, PAD after.

  Exchanging ids t <-> EOS in the embedding and the logits layer gives the same network
  under other token names, so its greedy output is the original one with t and EOS
  exchanged; a row must end at its first EOS with the right length.
  """
  model, params, inputs, (tokens, _) = setup
  # Choose t so rows end at different steps, one of them strictly inside the budget.
  def first(row, t):
    hits = np.flatnonzero(row == t)
    return hits[0] if hits.size else MAX_NEW
  candidates = [t for t in np.unique(tokens[:, 1:MAX_NEW - 1])
                if t not in (PAD_ID, EOS_ID) and len({first(r, t) for r in tokens}) > 1]
  assert candidates, "the greedy outputs are too uniform to pick a token to relabel"
  t = int(candidates[0])
  relabelled = relabel_params(params, t, EOS_ID)
  new_inputs = {k: jnp.asarray(swap_ids(v, t, EOS_ID)) for k, v in inputs.items()}
  out, lengths = run(model, relabelled, new_inputs)  # default sampling: stops at EOS_ID
  expected = swap_ids(tokens, t, EOS_ID)
  for b in range(4):
    stop = first(expected[b], EOS_ID)
    n = min(stop + 1, MAX_NEW)
    assert lengths[b] == n, f"row {b}: length {lengths[b]}, expected {n}"
    np.testing.assert_array_equal(out[b, :n], expected[b, :n], err_msg=f"row {b}")
    np.testing.assert_array_equal(out[b, n:], PAD_ID, err_msg=f"row {b}: tokens after EOS")
  assert lengths.min() < MAX_NEW and len(set(lengths.tolist())) > 1


def test_all_rows_end_at_first_step(setup):
  """Same prompt on every row, its first greedy token relabelled as EOS: [EOS, PAD, ...]."""
  model, params, inputs, _ = setup
  same = {k: jnp.repeat(v[:1], 4, axis=0) for k, v in inputs.items()}
  tokens, _ = run(model, params, same, sampling=NEVER_STOP)
  t = int(tokens[0, 0])
  assert t not in (PAD_ID, EOS_ID)
  relabelled = relabel_params(params, t, EOS_ID)
  same = {k: jnp.asarray(swap_ids(v, t, EOS_ID)) for k, v in same.items()}
  out, lengths = run(model, relabelled, same)
  np.testing.assert_array_equal(lengths, [1, 1, 1, 1])
  np.testing.assert_array_equal(out[:, 0], EOS_ID)
  np.testing.assert_array_equal(out[:, 1:], PAD_ID)


@pytest.mark.slow
def test_sampling_reproducible_per_key(setup):
  model, params, inputs, (greedy, _) = setup
  sampling = SamplingConfig(temperature=1.0, eos_id=-1)
  a, _ = run(model, params, inputs, sampling=sampling, rng=jax.random.PRNGKey(7))
  b, _ = run(model, params, inputs, sampling=sampling, rng=jax.random.PRNGKey(7))
  c, _ = run(model, params, inputs, sampling=sampling, rng=jax.random.PRNGKey(8))
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c), "a different key gave the same samples"
  assert not np.array_equal(a, greedy), "temperature 1 sampled exactly the greedy output"
  assert a.min() >= 0 and a.max() < model.config.vocab_size


def test_request_longer_than_cache_is_rejected():
  model, params = model_and_params("tiny_encoder_decoder")
  inputs = inputs_for(model)
  with pytest.raises(ValueError) as info:
    plain.decode(model, params, **inputs, max_new_tokens=128)
  message = str(info.value)
  assert "129" in message and "max_length=128" in message  # 1 start token + 128 > 128
  assert "raise max_length" in message and "max_new_tokens" in message
  with pytest.raises(ValueError, match="max_length=16"):
    plain.decode(model, params, **inputs, max_new_tokens=16, max_length=16)

  model, params = model_and_params("tiny_decoder_only")
  inputs = inputs_for(model)  # prompt width 6, plus the start token
  with pytest.raises(ValueError) as info:
    plain.decode(model, params, **inputs, max_new_tokens=122)
  assert "129" in str(info.value) and "max_length=128" in str(info.value)


def test_other_bad_requests():
  model, params = model_and_params("tiny_encoder_decoder")
  with pytest.raises(ValueError, match="encoder_input_tokens"):
    plain.decode(model, params, prompt_tokens=jnp.ones((1, 3), jnp.int32), max_new_tokens=2)
  with pytest.raises(ValueError, match=r"temperature=-1\.0 must be >= 0"):
    SamplingConfig(temperature=-1.0)


def test_probabilities_and_sample_tokens():
  logits = jnp.array([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
  np.testing.assert_array_equal(plain.probabilities(logits, 0.0), [[0, 1, 0], [1, 0, 0]])
  np.testing.assert_allclose(plain.probabilities(logits, 1.0), jax.nn.softmax(logits),
                             rtol=1e-6)
  np.testing.assert_array_equal(plain.sample_tokens(logits, jax.random.PRNGKey(0), 0.0), [1, 0])


def test_decode_arguments_are_checked():
  model, params = model_and_params("tiny_decoder_only")
  inputs = inputs_for(model)
  for bad in (0, -1):
    with pytest.raises(ValueError, match=f"max_new_tokens={bad} must be an integer >= 1"):
      plain.decode(model, params, **inputs, max_new_tokens=bad)
  with pytest.raises(ValueError, match="max_new_tokens=True is a bool"):
    plain.decode(model, params, **inputs, max_new_tokens=True)
  with pytest.raises(ValueError, match="max_length=0 must be an integer >= 1"):
    plain.decode(model, params, **inputs, max_new_tokens=4, max_length=0)
  # Exactly enough cache (start token + 6 prompt columns + 4 new tokens) runs, one less fails.
  exact = plain.decode(model, params, **inputs, max_new_tokens=np.int64(4), max_length=11)
  np.testing.assert_array_equal(exact.tokens, run(model, params, inputs, max_new_tokens=4)[0])
  with pytest.raises(ValueError, match="needs 11 decoder positions.*max_length=10"):
    plain.decode(model, params, **inputs, max_new_tokens=4, max_length=10)


def test_check_positive_int():
  assert validation.check_positive_int(np.int64(3), "n") == 3
  assert type(validation.check_positive_int(np.int32(2), "n")) is int
  for bad, message in [(0, "n=0 must"), (-1, "n=-1 must"), (True, "n=True is a bool"),
                       (np.bool_(True), "is a bool"), (2.0, "n=2.0 must be an integer"),
                       ("3", "n='3' must be an integer")]:
    with pytest.raises(ValueError, match=message):
      validation.check_positive_int(bad, "n")


def test_sampling_needs_a_key_greedy_does_not():
  model, params = model_and_params("tiny_encoder_decoder")
  inputs = inputs_for(model)
  with pytest.raises(ValueError, match=r"pass rng=jax.random.PRNGKey\(seed\)"):
    plain.decode(model, params, **inputs, max_new_tokens=3,
                    sampling=SamplingConfig(temperature=0.7))
  tokens, _ = run(model, params, inputs, max_new_tokens=3)  # greedy: no key needed
  assert tokens.shape == (4, 3)


def test_interior_prompt_padding_is_refused():
  model, params = model_and_params("tiny_decoder_only")
  prompts = np.array([[5, 6, 7, 0], [5, 0, 7, 0]], np.int32)
  for array in (prompts, jnp.asarray(prompts)):
    with pytest.raises(ValueError, match=r"row 1 has padding \(id 0\) at position 1"):
      plain.decode(model, params, prompt_tokens=array, max_new_tokens=2)
  plain.check_prompt_padding(np.array([[5, 6, 0, 0], [7, 0, 0, 0], [0, 0, 0, 0]]))
  with pytest.raises(ValueError, match="row 0 has padding .* at position 0"):
    plain.check_prompt_padding(np.array([[0, 5]]))


@pytest.mark.slow
def test_distillation_sampler_refuses_more_tokens_than_the_cache():
  from distillspec_jax.distill.objectives import sample_batch
  model, params = model_and_params("tiny_encoder_decoder")  # max_decode_length = 128
  batch = {"encoder_input_tokens": inputs_for(model)["encoder_input_tokens"],
           "decoder_target_tokens": jnp.ones((4, 8), jnp.int32)}
  with pytest.raises(ValueError, match="max_new_tokens=128.*max_length=128"):
    sample_batch(model, params, batch, jax.random.PRNGKey(0), max_new_tokens=128,
                 temperature=1.0)
  out = sample_batch(model, params, batch, jax.random.PRNGKey(0), max_new_tokens=127,
                     temperature=1.0)
  assert out["decoder_target_tokens"].shape == (4, 8)


def test_the_default_key_stays_concrete_when_first_made_inside_a_trace():
  """Greedy decoding inside a caller's jax.jit, with no key: the cached default key must not
  be the trace's tracer, which would leak into every later call (UnexpectedTracerError)."""
  plain.default_rng.cache_clear()
  traced = jax.jit(lambda x: plain.check_rng(None, SamplingConfig()) + x)
  traced(jnp.uint32(0))
  key = plain.default_rng()
  assert not isinstance(key, jax.core.Tracer)
  np.testing.assert_array_equal(key, jax.random.PRNGKey(0))


@pytest.mark.slow
def test_greedy_stops_at_a_stop_id(setup):
  """A further stop id (TokenIds.stop_ids: an instruct model's turn end beside its EOS) ends
  a row like EOS: the row is the never-stopping row cut after the first stop id or EOS, the
  stop id kept, PAD after; the same rows as decoding with that id as the one EOS."""
  from distillspec_jax.models.model import TokenIds
  model, params, inputs, (tokens, _) = setup
  def first(row, ids):
    hits = np.flatnonzero(np.isin(row, ids))
    return hits[0] if hits.size else MAX_NEW
  candidates = [t for t in np.unique(tokens[:, 1:MAX_NEW - 1])
                if t not in (PAD_ID, EOS_ID) and len({first(r, [t]) for r in tokens}) > 1]
  assert candidates, "the greedy outputs are too uniform to pick a stop id"
  stop = int(candidates[0])
  stopping = model.with_tokens(TokenIds(stop_ids=(stop,)))
  out, lengths = run(stopping, params, inputs)
  for b in range(4):
    n = min(first(tokens[b], [stop, EOS_ID]) + 1, MAX_NEW)
    assert lengths[b] == n, f"row {b}: length {lengths[b]}, expected {n}"
    np.testing.assert_array_equal(out[b, :n], tokens[b, :n], err_msg=f"row {b}")
    np.testing.assert_array_equal(out[b, n:], PAD_ID, err_msg=f"row {b}: tokens after the stop")
  assert lengths.min() < MAX_NEW and stop in out
  if EOS_ID not in tokens:  # the stop id alone ends these rows: as an EOS of that id does
    as_eos, as_eos_lengths = run(model, params, inputs, sampling=SamplingConfig(eos_id=stop))
    np.testing.assert_array_equal(as_eos, out)
    np.testing.assert_array_equal(as_eos_lengths, lengths)
