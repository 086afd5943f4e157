"""Teacher cache: binned divergences, cached vs live distillation, refusals, killed writers."""

import functools
import os
import pickle
import signal
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distillspec_jax.distill import divergences
from distillspec_jax.distill import teacher_cache
from distillspec_jax.training import trainer
from distillspec_jax.distill.objectives import DistillationConfig
from distillspec_jax.models.model import Model
from distillspec_jax.studies.pipeline import InMemoryData


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 32
TINY = dict(vocab_size=VOCAB, emb_dim=16, num_heads=2, head_dim=8, mlp_dim=32,
            num_encoder_layers=1, num_decoder_layers=1, max_decode_length=16)
TASK, LENGTHS = "synthetic_reverse", {"inputs": 6, "targets": 6}


def _models():
  target = Model.from_name("tiny_encoder_decoder", **TINY)
  draft = Model.from_name("tiny_encoder_decoder", **dict(TINY, emb_dim=8, mlp_dim=16))
  return target, draft


def _init(model, seed):
  return jax.jit(model.init)(jax.random.PRNGKey(seed))  # one compile, not one per op


def _zeros(model):
  """Parameters of the model's shapes without compiling its init (refusal tests)."""
  return jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), model.param_shapes())


def _arrays(rows=12):
  return trainer.SyntheticData(rows, input_length=6, target_length=6, vocab_size=VOCAB,
                               seed=3).batch_at(0)


def _random_logits(key, shape):
  logits = 3.0 * jax.random.normal(key, shape)
  return logits.at[0, 0, 5].set(-jnp.inf)  # a zero-probability entry (padded vocabulary)


# --- binned divergences ---------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=(0,))
def _dense_binned_and_grad(name, target_logits, draft_logits):
  """Dense divergence, binned ones at k = vocab, 16, 4, 1, and the k = vocab gradient."""
  log_p = divergences.log_probs(target_logits)
  binned = lambda k, d, lp=log_p: divergences.binned_token_divergence(
      name, *divergences.top_k_bins(lp, k), d, beta=0.3)
  # A finite target for the gradient: RKL is rightly infinite where the target has a zero
  # that the draft does not.
  finite_log_p = divergences.log_probs(jnp.where(jnp.isinf(target_logits), -30.0,
                                                 target_logits))
  grad = jax.grad(lambda d: jnp.sum(binned(VOCAB, d, finite_log_p)))(draft_logits)
  return (divergences.token_divergence(name, target_logits, draft_logits, beta=0.3),
          [binned(k, draft_logits) for k in (VOCAB, 16, 4, 1)], grad)


@pytest.mark.slow
@pytest.mark.parametrize("name", divergences.DIVERGENCES)
def test_binned_equals_dense_at_full_vocab_and_bounds_it_below(name):
  kp, kq = jax.random.split(jax.random.PRNGKey(0))
  dense, binned, grad = _dense_binned_and_grad(name, _random_logits(kp, (2, 3, VOCAB)),
                                               2.0 * jax.random.normal(kq, (2, 3, VOCAB)))
  dense = np.asarray(dense)
  np.testing.assert_allclose(binned[0], dense, rtol=1e-5, atol=1e-6)  # k = vocab
  gaps = []
  for smaller in binned[1:]:
    gaps.append(float(np.max(dense - np.asarray(smaller))))
    if name == "lk_lambda":  # no bound: its lambda reads the binned alpha (divergences.py)
      continue
    assert np.all(np.asarray(smaller) <= dense + 1e-6), (name, smaller, dense)
  assert max(gaps) > 1e-3  # coarser bins lose something (not a vacuous <=)
  assert np.all(np.isfinite(grad))  # empty tail bins on both sides: no NaN gradient


def test_tail_mass_is_the_complement():
  log_p = divergences.log_probs(_random_logits(jax.random.PRNGKey(1), (2, 3, VOCAB)))
  top, ids, tail = jax.jit(divergences.top_k_bins, static_argnums=1)(log_p, 5)
  total = jnp.exp(jax.nn.logsumexp(jnp.concatenate([top, tail[..., None]], -1), -1))
  np.testing.assert_allclose(total, 1.0, rtol=1e-6)
  assert np.all(np.diff(np.asarray(top), axis=-1) <= 0)


# --- cached distillation vs live target --------------------------------------------------------


def _train_config(path, steps=3):
  return trainer.TrainConfig(model_dir=str(path), train_steps=steps, batch_size=4,
                             optimizer="adamw", learning_rate=1e-2, warmup_steps=0,
                             decay_steps=steps, save_every=100, log_every=1, progress_bar=False)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
  """One full-vocabulary cache of the tiny target, shared by the tests below."""
  target, _ = _models()
  params = _init(target, 0)
  arrays = _arrays()
  path = str(tmp_path_factory.mktemp("cache") / "full")
  teacher_cache.write_cache(target, params, arrays, path, k=VOCAB, task=TASK, lengths=LENGTHS,
                            batch_size=8, shard_examples=5, progress=False)
  return target, params, arrays, path


@pytest.mark.slow
def test_cached_run_at_full_vocab_gives_the_live_run_params(written, tmp_path):
  target, target_params, arrays, path = written
  _, draft = _models()
  draft_params = _init(draft, 1)
  config = DistillationConfig.from_recipe("supervised_kd")
  live = trainer.distill(_train_config(tmp_path / "live"), target, target_params, draft,
                         InMemoryData(arrays, 4), config, init_params=draft_params)
  cache = _open(written)
  assert cache.k == VOCAB
  cached = trainer.train(_train_config(tmp_path / "cached"),
                         teacher_cache.CachedTeacherObjective(draft, config),
                         InMemoryData(teacher_cache.with_cache(arrays, cache), 4),
                         init_params=draft_params)
  moved = jax.tree.leaves(jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))),
                                       live.state.params, draft_params))
  assert max(moved) > 1e-3  # training changed the draft, so equality below means something
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=2e-6),
               cached.state.params, live.state.params)
  np.testing.assert_allclose([r["divergence"] for r in cached.history],
                             [r["divergence"] for r in live.history], rtol=1e-5)


# --- refusals -------------------------------------------------------------------------------


def _open(written, **changes):
  target, params, arrays, path = written
  kwargs = dict(target=target, target_params=params, arrays=arrays, k=VOCAB, task=TASK,
                lengths=LENGTHS)
  kwargs.update(changes)
  cache_dir = kwargs.pop("cache_dir", path)
  return teacher_cache.open_cache(cache_dir, **kwargs)


def test_cache_layout_and_rows(written):
  cache = _open(written)
  target, params, arrays, path = written
  assert cache.manifest["bytes_per_token"] == VOCAB * (4 + 2) + 4  # uint16 ids for 32 ids
  assert len(cache.manifest["shards"]) == 3  # 12 rows in shards of 5
  rows = np.asarray([11, 0, 5, 4])
  got = cache.arrays["teacher_top_log_probs"][rows]
  logits = jax.jit(target.logits)(params, {k: v[rows] for k, v in arrays.items()})
  log_p = divergences.log_probs(logits)
  np.testing.assert_allclose(got, jax.lax.top_k(log_p, VOCAB)[0], rtol=1e-5, atol=1e-6)


def test_cache_of_another_model_vocab_or_task_is_refused(written, tmp_path):
  target, params, arrays, path = written
  other_params = jax.tree.map(lambda a: np.asarray(a) * 1.5, params)
  with pytest.raises(ValueError, match=r"target parameters \(sha256\)"):
    _open(written, target_params=other_params)
  wider = Model.from_name("tiny_encoder_decoder", **dict(TINY, emb_dim=24))
  with pytest.raises(ValueError, match="another target model: parameter"):
    _open(written, target=wider, target_params=_zeros(wider))
  bigger = Model.from_name("tiny_encoder_decoder", **dict(TINY, vocab_size=40))
  with pytest.raises(ValueError, match="vocab_size=32.*vocab_size=40"):
    _open(written, target=bigger, target_params=_zeros(bigger))
  with pytest.raises(ValueError, match="task='synthetic_reverse'.*task='other_task'"):
    _open(written, task="other_task")
  with pytest.raises(ValueError, match="k=32.*k=4"):
    _open(written, k=4)
  with pytest.raises(ValueError, match="lengths="):
    _open(written, lengths={"inputs": 6, "targets": 7})
  with pytest.raises(ValueError, match="training split"):
    _open(written, arrays=_arrays(rows=8))
  missing = str(tmp_path / "nowhere")
  with pytest.raises(ValueError, match=f"teacher cache directory '{missing}' does not exist"):
    _open(written, cache_dir=missing)


def test_bad_k_and_sampling_recipes_are_refused(written):
  for k, match in ((0, "teacher_cache_k=0 must be an integer >= 1"),
                   (33, "teacher_cache_k=33 exceeds the vocabulary size 32"),
                   (2.5, "teacher_cache_k=2.5 must be an integer")):
    with pytest.raises(ValueError, match=match):
      teacher_cache.check_k(k, VOCAB)
    with pytest.raises(ValueError, match=match):
      _open(written, k=k)
  _, draft = _models()
  with pytest.raises(ValueError, match="lambda2=1.0: this recipe samples from the draft"):
    teacher_cache.CachedTeacherObjective(draft, DistillationConfig.from_recipe("gkd"))
  with pytest.raises(ValueError, match="lambda2=1.0: this recipe samples from the draft"):
    teacher_cache.CachedTeacherObjective(draft, DistillationConfig.from_recipe("imitkd"))
  with pytest.raises(ValueError, match="samples from the target every step"):
    teacher_cache.CachedTeacherObjective(draft, DistillationConfig.from_recipe("seqkd"))


# --- a writer killed with SIGKILL -------------------------------------------------------------

_WRITER = textwrap.dedent("""
    import os, pickle, signal, sys
    sys.path.insert(0, {repo!r})
    sys.path.insert(0, {tests!r})
    import jax
    from compilation import set_fast_compilation
    # Compiled as this module's tests are (compilation.py): the cache it writes is compared
    # bit for bit with one written in the test process.
    set_fast_compilation(True)
    from distillspec_jax.distill import teacher_cache
    import test_teacher_cache as t
    target, _ = t._models()
    params = pickle.load(open({params!r}, "rb"))

    def die(index):
      if index == 1:  # two shards done: leave a torn temporary of the third, then kill -9
        open(os.path.join({path!r}, "shard-00002.log_probs.npy.tmp-999"), "wb").write(b"torn")
        os.kill(os.getpid(), signal.SIGKILL)

    teacher_cache.write_cache(target, params, t._arrays(), {path!r}, k=t.VOCAB, task=t.TASK,
                              lengths=t.LENGTHS, batch_size=8, shard_examples=5,
                              progress=False, on_shard=die)
""")


@pytest.mark.integration
def test_killed_writer_is_never_read_and_the_rerun_finishes(written, tmp_path):
  target, params, arrays, complete = written
  path = str(tmp_path / "killed")
  params_path = str(tmp_path / "params.pkl")
  with open(params_path, "wb") as f:
    pickle.dump(jax.device_get(params), f)
  script = _WRITER.format(repo=REPO, tests=os.path.join(REPO, "tests"), path=path,
                          params=params_path)
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True)
  assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
  assert os.path.exists(os.path.join(path, "shard-00001.json"))
  assert not os.path.exists(os.path.join(path, teacher_cache.MANIFEST))
  with pytest.raises(ValueError, match="holds no complete teacher cache"):
    _open(written, cache_dir=path)
  # A shard whose arrays are there but whose json is not (killed between them) is redone.
  os.remove(os.path.join(path, "shard-00001.json"))
  manifest = teacher_cache.write_cache(target, params, arrays, path, k=VOCAB, task=TASK,
                                       lengths=LENGTHS, batch_size=8, shard_examples=5,
                                       progress=False)
  assert manifest["reused_shards"] == 1
  assert not [f for f in os.listdir(path) if ".tmp-" in f]
  resumed, clean = _open(written, cache_dir=path), _open(written)
  for name in teacher_cache.FEATURES.values():
    np.testing.assert_array_equal(resumed.arrays[name][np.arange(12)],
                                  clean.arrays[name][np.arange(12)])
