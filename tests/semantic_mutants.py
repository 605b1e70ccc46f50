# ruff: noqa: E501  (a table of source snippets, kept on one line each so they can be read against the source)
"""Semantic mutants: for each invariant of jddp's design and each documented guarantee, the bug that breaks it.

mutmut's mutants are syntactic (``<`` for ``<=``, a string changed); they missed bugs that a tired engineer
writes: an average of per-device averages, a gradient summed twice, a sampler that shuffles per process. Each
``Mutant`` here is one such bug, written as a small source patch (or a replacement) of one function of
``jddp``, with the guarantee it breaks (quoted from the file that documents it) and the tests that must fail
when it is applied.

As a pytest plugin (``python -m pytest -p tests.semantic_mutants ...``) this module applies the mutant named
by ``$JDDP_SEMANTIC_MUTANT`` in ``pytest_configure``: after the root conftest (8 CPU devices) and before any
test builds or traces a program, so no jitted trace caches the original. Without the variable it does
nothing. ``tools/semantic_mutants.py`` runs each mutant's tests in a fresh process and reports killed or
survived. Test code that starts processes of its own calls ``apply_from_env()`` in them.

The lists ``CORE`` (the seven invariants of the design) and ``doc_guarantees()`` (read from the docs) are
checked by ``tests/test_semantic_mutants.py``: each needs a mutant, so a guarantee added to the docs without
one fails there.
"""

from __future__ import annotations
import __future__

import dataclasses
import importlib
import inspect
import os
import re
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

ENV = "JDDP_SEMANTIC_MUTANT"
ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Patch:
    """``target`` ("module:Qual.name") with each ``old`` text of its source replaced by ``new`` (exactly once)."""

    target: str
    edits: tuple[tuple[str, str], ...]


@dataclasses.dataclass(frozen=True)
class Replace:
    """``target`` replaced by ``make(original)``."""

    target: str
    make: Callable


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    doc: str  # the file that documents the guarantee, relative to the repository
    quote: str  # the guarantee, verbatim from ``doc`` (whitespace-normalised)
    bug: str  # the bug, in words
    patches: tuple[Patch | Replace, ...]
    tests: tuple[str, ...]  # pytest node ids; at least one must fail with the mutant applied
    needs: str | None = None  # a module the killing tests need (they skip without it)


def _p(target: str, *edits: tuple[str, str]) -> Patch:
    return Patch(target, tuple(edits))


E, G, Z = "tests/test_engine.py", "tests/test_guarantees.py", "tests/test_zero.py"
S, L, C = "tests/test_sampler.py", "tests/test_loader.py", "tests/test_checkpoint.py"
A, M = "tests/test_checkpoint_access.py", "tests/test_any_model.py"
EB = "tests/test_elastic_batches.py"
README, GLOSSARY, ENGINE = "README.md", "docs/glossary.md", "docs/guides/engine.md"
DATA, CKPT_MD = "docs/guides/data.md", "docs/guides/checkpoints.md"
SAMPLER, CKPT = "jddp/data/sampler.py", "jddp/checkpoint/__init__.py"

STEP = "jddp.engine.step:DeviceStep"
MEMORY = "jddp/runtime/memory.py"
BB = "tests/test_between_backward_and_update.py"
LS, CT, AC = "tests/test_engine_loss_scale.py", "tests/test_engine_contracts.py", "tests/test_engine_accumulation.py"
PORTING, OWN = "docs/guides/porting.md", "tests/test_own_step.py"
ID, SBS, EX = (
    "tests/test_checkpoint_identity.py",
    "tests/test_checkpoint_side_by_side.py",
    "tests/test_checkpoint_existing.py",
)

MUTANTS: tuple[Mutant, ...] = (
    # ------------------------------------------------------------------ your own train step
    Mutant(
        "own_step_average_of_averages",
        PORTING,
        "`jddp.average_gradients()` makes each device's gradient the mean over the global batch's real examples, "
        "weighted by each device's count of them",
        "each device's gradient weighted 1 instead of by its real examples (DDP's average of averages)",
        (
            _p(
                "jddp.engine.own_step:global_mean",
                ("[x * weight.astype(x.dtype) for x in values], weight", "values, weight * 0 + 1"),
            ),
        ),
        (f"{OWN}::test_global_mean_is_the_weighted_mean_of_numpy",),
    ),
    Mutant(
        "own_step_returns_device_0s_value",
        PORTING,
        "a value that still depends on the device's slice",
        "an output that differs across devices comes back as device 0's, without a word",
        (_p("jddp.engine.own_step:DataParallelStep._build", ("if differ:", "if False:")),),
        (
            f"{OWN}::test_a_step_that_averages_nothing_is_refused_naming_the_output",
            f"{OWN}::test_a_metric_left_unaveraged_is_refused_naming_it",
        ),
    ),
    # ------------------------------------------------------------------ exact means
    Mutant(
        "average_of_averages",
        GLOSSARY,
        "jddp all-reduces totals and counts with the gradient and divides once, so uneven or padded batches give "
        "the exact global mean gradient and metrics",
        "each device's mean loss weighted 1 instead of by its real-example count (DDP's average of averages)",
        (_p("jddp.engine.reduce:as_weighted", ("total, weight = None, count", "total, weight = None, count * 0 + 1")),),
        (f"{E}::test_uneven_masks_give_exact_global_mean", f"{E}::test_accumulate_with_uneven_masks_is_exact"),
    ),
    Mutant(
        "padding_counted",
        README,
        "Gradients and metrics are the **exact** mean over the real (unmasked) examples of the global batch",
        "a device's count is its batch size, the mask ignored: padding rows weigh like real examples",
        (_p("jddp.engine.reduce:example_count", ("if mask is not None:", "if False:")),),
        (f"{E}::test_uneven_masks_give_exact_global_mean",),
    ),
    # ------------------------------------------------------------------ summed once
    Mutant(
        "gradient_summed_twice",
        GLOSSARY,
        "Under `check_vma=False` the gradient is the device's own, and jddp all-reduces exactly once, explicitly",
        "the already-summed gradient summed (pmean-ed as a sum) again: N x the gradient",
        (
            _p(
                f"{STEP}.local_step",
                (
                    "grads_sum = self._unwire(grads_sum, rows)",
                    "grads_sum = lax.psum(self._unwire(grads_sum, rows), DATA)",
                ),
            ),
        ),
        (f"{E}::test_gradient_is_not_summed_over_devices", f"{E}::test_equivalence_to_one_device_and_pmap"),
    ),
    Mutant(
        "two_all_reduces",
        GLOSSARY,
        "Gradients, loss and metric totals, counts and unsynchronised model state travel in one all-reduce op",
        "the gradients all-reduced on their own, the loss, counts and model state in a second collective",
        (
            _p(
                f"{STEP}.local_step",
                (
                    "grads_sum, sums, synced_sum = self.psum((self._wire(grads, rows), sums, varying_state), DATA)",
                    "grads_sum = self.psum(self._wire(grads, rows), DATA)\n"
                    "    sums, synced_sum = lax.psum((sums, varying_state), DATA)",
                ),
            ),
        ),
        (f"{E}::test_comm_report_moves_exactly_the_gradient_bytes",),
    ),
    # ------------------------------------------------------------------ identical replicas
    Mutant(
        "replicas_from_own_process",
        GLOSSARY,
        "`DDP(model)` (broadcasts rank 0's weights) | `dp = jddp.DataParallel(loss_fn, optimizer, "
        "mesh=jddp.data_mesh())`; `dp.init(params)` replicates",
        "init places each process's own values (no broadcast from process 0)",
        (Replace("jddp.engine.replicas:broadcast_from_process_0", lambda original: lambda tree: tree),),
        (f"{G}::test_init_replicates_process_0s_values_over_two_processes",),
    ),
    Mutant(
        "replica_check_reads_one_device",
        ENGINE,
        "`dp.check_replicas(state)` checks that every replica is bit-identical",
        "the checksum table read for the first device only, so a differing replica is never seen",
        (
            _p(
                "jddp.engine.replicas:check_replicas",
                ("rows = [tuple(r) for r in table[:, leaf]]", "rows = [tuple(r) for r in table[:1, leaf]]"),
            ),
        ),
        ("tests/test_replica_check.py::test_a_one_ulp_change_in_one_replica_is_named",),
    ),
    # ------------------------------------------------------------------ model state
    Mutant(
        "varying_analysis_says_invariant",
        ENGINE,
        "Model state computed per device without an axis name is averaged over replicas after each step",
        "jddp.engine.varying finds every model-state leaf invariant: per-device statistics are never averaged",
        (
            _p(
                "jddp.engine.varying:varying_outputs",
                ("return _jaxpr(", "return [False for _ in closed.jaxpr.outvars] or _jaxpr("),
            ),
        ),
        (
            f"{E}::test_unsynchronised_model_state_is_averaged",
            f"{M}::test_a_statistic_of_the_local_batch_is_averaged_to_the_global_one",
        ),
    ),
    Mutant(
        "varying_analysis_psum_varies",
        GLOSSARY,
        "a leaf varies if it depends on the batch, except through a `psum`/`pmean`/`all_gather`",
        "psum/pmean results called varying, so statistics the model synchronised are averaged again",
        (
            _p(
                "jddp.engine.varying:_equation",
                ("return [False if axis in axes else any(ins)] * n_out", "return [any(ins)] * n_out"),
            ),
        ),
        (f"{M}::test_a_statistic_synchronised_by_the_model_is_left_as_it_is",),
    ),
    Mutant(
        "model_state_summed_not_averaged",
        ENGINE,
        "Model state computed per device without an axis name is averaged over replicas after each step",
        "the varying model state all-reduced but not divided by the device count (a sum, N x)",
        (_p(f"{STEP}.local_step", ("[x / self.num_devices for x in synced_sum]", "list(synced_sum)")),),
        (f"{E}::test_unsynchronised_model_state_is_averaged",),
    ),
    # ------------------------------------------------------------------ one buffer, bounded dispatch
    Mutant(
        "fused_psum_packs_nothing",
        GLOSSARY,
        "jddp packs the gradient leaves up to 1 MiB and the scalars into one flat buffer per dtype",
        "every leaf counted as large, so nothing is packed: one operand (one gloo ring pass) per leaf",
        (
            _p(
                "jddp.engine.fused:fused_psum",
                ("groups, large = _grouped(leaves, max_leaf_bytes)", "groups, large = {}, list(range(len(leaves)))"),
            ),
        ),
        (
            f"{E}::test_fused_psum_packs_small_leaves_and_leaves_large_ones_alone",
            f"{E}::test_comm_report_moves_exactly_the_gradient_bytes",
        ),
    ),
    Mutant(
        "dispatch_unbounded",
        GLOSSARY,
        "Every jddp program goes through one dispatcher that keeps at most `max_inflight` (2) steps ahead",
        "the dispatcher never waits for the oldest step: any number of steps in flight",
        (_p("jddp.runtime.dispatch:Dispatcher.before", ("while len(self._pending) >= max_inflight:", "while False:")),),
        (f"{G}::test_the_dispatcher_keeps_at_most_max_inflight_steps_in_flight",),
    ),
    # ------------------------------------------------------------------ options
    Mutant(
        "accumulate_reduces_every_micro_batch",
        ENGINE,
        "`accumulate_steps`: micro-batches, one all-reduce (DDP's `no_sync`).",
        "each micro-batch's gradient all-reduced inside the scan (k all-reduces; the sum summed again)",
        (
            _p(
                f"{STEP}._accumulate",
                (
                    "g, ms, s = self._local_grads(params, ms, mb, key if per_example else jax.random.fold_in(key, i), scale, i)",
                    "g, ms, s = self._local_grads(params, ms, mb, key if per_example else jax.random.fold_in(key, i), scale, i); "
                    "g = self.psum(g, DATA)",
                ),
            ),
        ),
        (f"{E}::test_accumulate_steps_equals_whole_batch", f"{E}::test_accumulate_with_uneven_masks_is_exact"),
    ),
    Mutant(
        "accumulate_averages_micro_means",
        ENGINE,
        "`accumulate_steps`: micro-batches, one all-reduce (DDP's `no_sync`).",
        "the accumulated gradient divided by accumulate_steps (PyTorch's loss / k habit) on top of the count",
        (
            _p(
                f"{STEP}._accumulate",
                ("return grads, model_state, sums", "return jax.tree.map(lambda g: g / k, grads), model_state, sums"),
            ),
        ),
        (f"{E}::test_accumulate_steps_equals_whole_batch",),
    ),
    Mutant(
        "reduce_dtype_ignored",
        ENGINE,
        "`reduce_dtype=jnp.bfloat16`: DDP's bf16 compression hook.",
        "the gradients reduced in their own dtype whatever reduce_dtype says",
        (_p(f"{STEP}._wire", ("if wire is None:", "if True:")),),
        (f"{E}::test_bf16_reduce_puts_bf16_on_the_wire_and_rounds", f"{Z}::test_bf16_reduction_scatters_bf16"),
    ),
    Mutant(
        "float16_reduce_sums_totals",
        ENGINE,
        "`reduce_dtype=jnp.bfloat16`: DDP's bf16 compression hook.",
        "a float16 reduction sums gradient totals (overflows at 65504) instead of per-device means",
        (_p(f"{STEP}._narrow", ("return wire is not None and", "return False and")),),
        (f"{E}::test_float16_reduce_sums_means_not_totals",),
    ),
    Mutant(
        "clip_before_averaging",
        ENGINE,
        "`clip_grad_norm`: applied after averaging.",
        "the clip threshold compared with the norm of the summed gradient (before dividing by the count)",
        (
            _p(
                f"{STEP}._apply",
                (
                    "jnp.where(grad_norm > opts.clip_grad_norm, opts.clip_grad_norm / grad_norm, 1.0)",
                    "jnp.where(norm > opts.clip_grad_norm, opts.clip_grad_norm / norm, 1.0)",
                ),
            ),
        ),
        (f"{E}::test_clip_grad_norm_after_averaging",),
    ),
    Mutant(
        "nonfinite_checks_only_the_loss",
        ENGINE,
        "a non-finite loss or gradient skips the update on every replica",
        "the non-finite guard reads the loss only: a finite loss with an inf gradient updates to NaN",
        (
            _p(
                f"{STEP}._apply",
                ("finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)", "finite = jnp.isfinite(loss)"),
            ),
        ),
        (f"{G}::test_a_finite_loss_with_an_infinite_gradient_skips_the_update",),
    ),
    Mutant(
        "donate_ignored",
        ENGINE,
        "`donate`: donate the state to the step.",
        "the step compiled without donation whatever donate says (2x the state's memory)",
        (
            _p(
                "jddp.engine.programs:Programs._compile",
                ("donate_argnums=(0,) if donate else ()", "donate_argnums=()"),
            ),
        ),
        (f"{E}::test_state_is_donated_and_caller_arrays_survive",),
    ),
    Mutant(
        "eval_counts_padding",
        ENGINE,
        "`eval_fn`: for `eval_step`, exact masked means.",
        "eval weights each device's means by its rows, padding included",
        (
            _p(
                f"{STEP}.local_eval",
                (
                    "count = reduce.example_count(batch, leading_size(batch))",
                    "count = jnp.float32(leading_size(batch))",
                ),
            ),
        ),
        (
            f"{E}::test_eval_step_exact_over_padded_batch",
            f"{L}::test_evaluation_over_a_ragged_dataset_equals_one_device",
        ),
    ),
    Mutant(
        "evaluate_weights_by_examples",
        DATA,
        "every example once, padding masked: exact single-device metrics",
        "evaluate combines batches weighting each mean by its examples instead of its own weight (tokens)",
        (
            _p(
                "jddp.engine.parallel:DataParallel.evaluate",
                ("+ m[name] * weight", '+ m[name] * m["examples"]'),
                ("weights.get(name, 0.0) + weight", 'weights.get(name, 0.0) + m["examples"]'),
            ),
        ),
        (
            f"{L}::test_weighted_metrics_combine_exactly_across_batches",
            f"{G}::test_evaluate_combines_batches_by_each_metrics_own_weight",
        ),
    ),
    Mutant(
        "zero_norm_from_local_slices",
        ENGINE,
        "The global gradient norm follows, so clipping and the non-finite guard read the same value on every device.",
        "ZeRO-1's squared norm left out of the all-reduce: each device clips by the norm of its own slices",
        (
            _p(
                f"{STEP}.local_scatter",
                (
                    "sums, synced_sum, whole, squares = self.psum((sums, varying_state, whole, squares), DATA)",
                    "sums, synced_sum, whole = self.psum((sums, varying_state, whole), DATA)",
                ),
            ),
        ),
        (f"{Z}::test_equals_replicated_engine_after_20_steps",),
    ),
    Mutant(
        "zero_gathers_slices_in_reverse_order",
        ENGINE,
        "`shard_optimizer`: ZeRO-1, the optimizer state split over the devices",
        "ZeRO-1's packed all-gather reassembles the devices' slices in the wrong (reversed) order",
        (
            _p(
                "jddp.engine.fused:fused_all_gather",
                ("whole = every[:, offset : offset + size]", "whole = every[::-1, offset : offset + size]"),
            ),
        ),
        (
            f"{Z}::test_fused_scatter_and_gather_match_per_leaf_collectives",
            f"{Z}::test_fused_buffers_train_alike_with_one_collective_each",
        ),
    ),
    # ------------------------------------------------------------------ sampler and loader
    Mutant(
        "sampler_shuffles_per_process",
        SAMPLER,
        "the sequence of global batches depends on ``(dataset_size, seed, shuffle, drop_last, global_batch_size)`` "
        "only, never on ``num_replicas``",
        "each process draws its own permutation (seeded with its rank) instead of one global order",
        (
            _p(
                "jddp.data.sampler:DistributedBatchSampler.order",
                ("default_rng([self.seed, epoch])", "default_rng([self.seed, epoch, self.rank])"),
            ),
        ),
        (
            f"{S}::test_global_batches_do_not_depend_on_replicas",
            f"{S}::test_slices_disjoint_and_epoch_covers_each_example_once",
        ),
    ),
    Mutant(
        "sampler_slices_overlap",
        SAMPLER,
        "slices of one global batch are disjoint, and within an epoch every example appears exactly once",
        "a replica's slice starts at its rank, not at rank x local batch size: slices overlap",
        (
            _p(
                "jddp.data.sampler:DistributedBatchSampler.local_block",
                ("self.rank * self.local_batch_size, self.local_batch_size)", "self.rank, self.local_batch_size)"),
            ),
        ),
        (f"{S}::test_slices_disjoint_and_epoch_covers_each_example_once",),
    ),
    Mutant(
        "sampler_padding_not_masked",
        SAMPLER,
        "with ``drop_last=False`` the last global batch is filled up with padding entries whose mask is 0",
        "the padding entries (repeats of real examples) get mask 1 and count twice",
        (
            _p(
                "jddp.data.sampler:DistributedBatchSampler._block",
                ("mask = valid.astype(np.float32)", "mask = np.ones_like(valid, np.float32)"),
            ),
        ),
        (
            f"{S}::test_slices_disjoint_and_epoch_covers_each_example_once",
            f"{L}::test_evaluation_over_a_ragged_dataset_equals_one_device",
        ),
    ),
    Mutant(
        "sampler_order_ignores_the_epoch",
        SAMPLER,
        "the epoch follows from the position, so an order never repeats because ``set_epoch`` was forgotten",
        "the order drawn from the seed alone: every epoch repeats the first one's order",
        (
            _p(
                "jddp.data.sampler:DistributedBatchSampler.order",
                ("default_rng([self.seed, epoch])", "default_rng([self.seed, 0])"),
            ),
        ),
        (f"{S}::test_forgetting_set_epoch_does_not_repeat_the_order", f"{S}::test_epochs_differ_and_seed_repeats"),
    ),
    Mutant(
        "set_epoch_ignored",
        "docs/glossary.md",
        "optional: the epoch follows from the position, so forgetting it never repeats an order",
        "set_epoch does nothing: a loop that calls it to jump reads the wrong epoch",
        (_p("jddp.data.sampler:DistributedBatchSampler.set_epoch", ("self.position = epoch * len(self)", "pass")),),
        (f"{L}::test_stream_restarts_where_the_position_moved",),
    ),
    Mutant(
        "sampler_resume_drops_the_position",
        SAMPLER,
        "``load_state_dict`` accepts it on any ``num_replicas`` and continues the same global sequence",
        "load_state_dict checks the state but keeps its own position (restarts the data from the beginning)",
        (
            _p(
                "jddp.data.sampler:DistributedBatchSampler.load_state_dict",
                ('self.position = int(state["position"])', "pass"),
            ),
        ),
        (
            f"{S}::test_resume_on_any_replica_count_continues_the_sequence",
            f"{L}::test_resume_continues_the_uninterrupted_sequence",
        ),
    ),
    # ------------------------------------------------------------------ checkpoints
    Mutant(
        "checkpoint_drops_the_data_position",
        CKPT_MD,
        "the complete state (parameters, optimizer, model state, RNG, step) plus the loader's global position",
        "save writes the state but not the loader's position: a resume re-reads the epoch from its start",
        (
            _p(
                "jddp.checkpoint.orbax_io:step_items",
                ("items[LOADER] = ocp.args.JsonSave(loader.get_state())", "pass"),
            ),
        ),
        (f"{C}::test_resume_is_bitwise_exact_and_continues_the_data_sequence",),
    ),
    Mutant(
        "restore_ignores_the_saved_step",
        CKPT_MD,
        "the complete state (parameters, optimizer, model state, RNG, step) plus the loader's global position",
        "the restored state keeps the step of the state passed in (0), not the saved one",
        (
            _p(
                "jddp.checkpoint.restore:try_restore",
                (
                    "new_state = TrainState(**tree, opt_layout=state.opt_layout)",
                    'new_state = TrainState(**{**tree, "step": state.step}, opt_layout=state.opt_layout)',
                ),
            ),
        ),
        (
            f"{C}::test_resume_is_bitwise_exact_and_continues_the_data_sequence",
            f"{C}::test_damaged_latest_checkpoint_falls_back_to_the_previous_one",
        ),
    ),
    Mutant(
        "restore_skips_the_digests",
        CKPT,
        "jddp recomputes each leaf's digest after a restore",
        "the digests are saved but never compared: flipped bytes restore as garbage",
        (_p("jddp.checkpoint.restore:try_restore", ("if got != want]", "if False]")),),
        (f"{C}::test_damaged_latest_checkpoint_falls_back_to_the_previous_one",),
    ),
    Mutant(
        "leftover_temporary_directories_kept",
        CKPT,
        "Leftover temporary directories are removed when a ``Checkpointer`` opens the directory.",
        "Orbax's clean-up of unfinished <step>.orbax-checkpoint-tmp-* directories turned off",
        (
            _p(
                "jddp.checkpoint.orbax_io:manager_options",
                ("cleanup_tmp_directories=not read_only", "cleanup_tmp_directories=False"),
            ),
        ),
        (
            f"{G}::test_an_unfinished_save_is_not_published_and_is_cleaned_up",
            f"{C}::test_a_kill_during_an_async_save_leaves_the_previous_checkpoint",
        ),
    ),
    Mutant(
        "damaged_steps_deleted",
        CKPT,
        "Nothing is deleted: the ``<step>.damaged`` directories stay",
        "a damaged step is deleted instead of renamed <step>.damaged",
        (_p("jddp.checkpoint.restore:set_aside", ("shutil.move(source, target)", "shutil.rmtree(source)")),),
        (
            f"{C}::test_every_checkpoint_damaged_starts_afresh_with_a_warning_and_keeps_them",
            f"{C}::test_damaged_latest_checkpoint_falls_back_to_the_previous_one",
        ),
    ),
    Mutant(
        "no_lease",
        CKPT,
        "A second writer (a relaunch beside the running job, a notebook) gets ``CheckpointLeaseError`` naming the owner",
        "the writer takes no lease: a second writer opens the directory and cleans up the first one's save",
        (Replace("jddp.checkpoint.lease:take", lambda original: lambda directory, timeout_s: None),),
        (f"{A}::test_a_second_writer_is_refused_naming_the_owner_and_touches_nothing",),
    ),
    Mutant(
        "reader_sets_damaged_steps_aside",
        CKPT,
        "never renames a damaged step",
        "a read-only Checkpointer renames a damaged step like a writer (under the trainer's feet)",
        (
            _p(
                "jddp.checkpoint.restoring:Restoring._restore_from_disk",
                ("if not self.read_only:\n            restore.set_aside", "if True:\n            restore.set_aside"),
            ),
        ),
        (f"{A}::test_read_only_leaves_a_damaged_step_in_place",),
    ),
    Mutant(
        "failed_write_counted_as_saved",
        CKPT,
        "The failed steps are not counted as saved: the next ``save`` writes the step again.",
        "after a failed write the step stays recorded as the last saved, so saving it again is skipped",
        (
            _p(
                "jddp.checkpoint.lifecycle:Lifecycle._write_errors",
                ("self._unconfirmed, self._last_saved = [], None", "self._unconfirmed = []"),
            ),
        ),
        (f"{G}::test_a_failed_write_is_raised_once_and_the_next_save_writes_the_step",),
    ),
    Mutant(
        "missing_loader_position_is_damage",
        CKPT,
        "A checkpoint saved without a loader, restored with one, is not damage",
        "the restore asks Orbax for the loader item whether or not the step has one: the step is set aside",
        (
            _p(
                "jddp.checkpoint.restore:try_restore",
                ("if loader is not None and has_loader:", "if loader is not None:"),
            ),
        ),
        (f"{A}::test_a_checkpoint_without_a_loader_position_restores_the_model_and_says_so",),
    ),
    Mutant(
        "restore_into_the_saved_sharding",
        CKPT,
        "The state is restored into the shardings of the ``state`` passed to ``restore_or_init`` (Orbax reshards)",
        "the restore target carries no sharding, so Orbax restores the arrays as they were saved",
        (
            _p(
                "jddp.checkpoint.restore:try_restore",
                (
                    "jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)",
                    "jax.ShapeDtypeStruct(x.shape, x.dtype)",
                ),
            ),
        ),
        (f"{C}::test_restore_onto_other_device_counts_continues_the_same_batches",),
    ),
    Mutant(
        "snapshot_published_before_written",
        CKPT,
        "each written beside them and renamed when complete, with a CRC-32: a kill during a write leaves the older "
        "ones.",
        "a snapshot is written straight into its step's file (the oldest's pages reused there): a kill mid-write "
        "leaves a torn file under a step's name",
        (
            _p(
                "jddp.checkpoint.snapshot:Snapshots._write_file",
                ("    target = self.folder / temporary\n", '    target = self.folder / f"{pending.step}{SUFFIX}"\n'),
            ),
        ),
        (
            "tests/test_snapshot.py::test_a_kill_at_any_point_of_a_write_leaves_the_complete_snapshots_and_no_torn_one",
            "tests/test_snapshot.py::test_a_real_sigkill_during_writes_leaves_complete_snapshots_only",
        ),
    ),
    Mutant(
        "kept_step_not_written_at_the_flush",
        CKPT,
        "When ``jddp launch`` ends the survivors of a failure, each writes the newest kept step that completed as a "
        "snapshot, and the restart restores it from that peer",
        "the survivors write nothing as they are ended: the restart restores the last snapshot or checkpoint, and "
        "the steps since are recomputed",
        (
            _p(
                "jddp.checkpoint.snapshot:Snapshots.write_kept",
                ("    newest = max(self.steps(), default=-1)\n", "    return None\n"),
            ),
        ),
        (
            "tests/test_snapshot_kept.py::test_a_process_killed_between_snapshots_is_resumed_at_its_last_step_from_a_"
            "survivors_kept_step",
        ),
    ),
    Mutant(
        "kept_step_behind_a_step_every_process_holds",
        CKPT,
        "The restore takes a step some process holds before an older one every process holds.",
        "the restore takes the newest step every process holds first: a survivor's newer kept step is ignored",
        (_p("jddp.checkpoint.snapshot_restore:from_memory", ("    if from_peer and common:", "    if False:")),),
        (
            "tests/test_snapshot_kept.py::test_a_process_killed_between_snapshots_is_resumed_at_its_last_step_from_a_"
            "survivors_kept_step",
        ),
    ),
    Mutant(
        "snapshot_older_than_the_disk",
        CKPT,
        "restores the newest step that every process holds, when it is not older than the disk's newest",
        "the snapshot steps tried ignore the disk: a restart restores an older snapshot over a newer checkpoint",
        (
            _p(
                "jddp.checkpoint.snapshot:choose",
                ("if s >= newest_disk), reverse=True)", "), reverse=True)"),
            ),
        ),
        ("tests/test_snapshot.py::test_the_steps_tried_are_those_every_process_holds_not_older_than_any_disk_step",),
    ),
    Mutant(
        "sigterm_not_noticed",
        CKPT,
        "A single process stops at the next ``maybe_save``.",
        "the SIGTERM flag is not read: only JAX's sync point, which a single process never has, stops training",
        (
            _p(
                "jddp.checkpoint.preemption:Preemption.reached",
                ("self.notice or _SIGTERM.is_set() or", "self.notice or"),
            ),
        ),
        (
            f"{G}::test_a_sigterm_saves_the_step_at_the_next_maybe_save",
            f"{C}::test_close_restores_sigterm_and_forgets_a_notice_it_acted_on",
        ),
    ),
    Mutant(
        "save_waits_for_the_write",
        CKPT,
        "``save`` returns before the files are written; ``close`` waits.",
        "save blocks until Orbax has written the step (a synchronous save)",
        (
            _p(
                "jddp.checkpoint.saving:Saving.save",
                (
                    "    if wait:\n        self.wait()\n    return step\n",
                    "    self.wait()\n    return step\n",
                ),
            ),
        ),
        (f"{G}::test_save_returns_while_the_write_is_still_running",),
    ),
    Mutant(
        "save_decided_by_one_process",
        CKPT,
        "``maybe_save`` decides from a step counter every process keeps the same way",
        "maybe_save counts steps from the state it is given, so a process that saw another step saves at others",
        (
            _p(
                "jddp.checkpoint.saving:Saving.maybe_save",
                ("self._step += 1", "self._step = int(jax.device_get(state.step))"),
            ),
        ),
        (f"{G}::test_maybe_save_counts_its_own_steps",),
    ),
    # ------------------------------------------------------------------ the same run on any device count
    Mutant(
        "padded_slots_counted",
        SAMPLER,
        "so are the slots past ``B``",
        "the padding slots past the global batch size get mask 1 wherever they re-read an example",
        (
            _p(
                "jddp.data.sampler:DistributedBatchSampler._block",
                (
                    "valid = (places < self.dataset_size) & (slots < self.global_batch_size)",
                    "valid = places < self.dataset_size",
                ),
            ),
        ),
        (
            f"{S}::test_padding_keeps_each_real_example_in_its_slot_on_any_replica_count",
            f"{EB}::test_mlp_trains_as_plain_sgd_on_any_device_count",
        ),
    ),
    Mutant(
        "padded_batches_strided_by_slots",
        SAMPLER,
        "nor on ``padded_batch_size``, which moves no real example from its slot",
        "global batch b starts at entry b * padded_batch_size of the order: padding shifts every later batch",
        (
            _p(
                "jddp.data.sampler:DistributedBatchSampler._block",
                (
                    "* self.global_batch_size)[:, None] + slots",
                    "* self.padded_batch_size)[:, None] + slots",
                ),
            ),
        ),
        (f"{S}::test_padding_keeps_each_real_example_in_its_slot_on_any_replica_count",),
    ),
    Mutant(
        "accumulate_steps_from_floor",
        DATA,
        "it sets `loader.accumulate_steps = k = ceil(B / (D * L))`",
        "the micro-batch count rounded down, so a micro-batch takes more rows than the limit",
        (
            _p(
                "jddp.data.sizes:split_batch",
                (
                    "k = -(-global_batch_size // (devices * max_per_device))",
                    "k = max(1, global_batch_size // (devices * max_per_device))",
                ),
            ),
        ),
        (f"{L}::test_max_per_device_pads_to_the_fewest_micro_batches_and_keeps_the_examples",),
    ),
    Mutant(
        "fit_takes_other_accumulate_steps",
        DATA,
        "`jddp.fit` refuses other values before the first step",
        "fit trains with a DataParallel whose accumulate_steps differ from the loader's",
        (
            _p(
                "jddp.data.loader:check_accumulate_steps",
                (
                    "if loader.max_per_device_batch_size is not None and",
                    "if False and",
                ),
            ),
        ),
        (f"{EB}::test_fit_refuses_a_data_parallel_with_other_accumulate_steps_before_any_step",),
    ),
    Mutant(
        "micro_batch_index_folded_into_the_key",
        ENGINE,
        "With `accumulate_steps` every micro-batch gets the step's key and its rows' draws from the global batch's",
        "each micro-batch draws with its index folded into the key: dropout masks depend on accumulate_steps",
        (
            _p(
                f"{STEP}._accumulate",
                ("key if per_example else jax.random.fold_in(key, i)", "jax.random.fold_in(key, i)"),
            ),
        ),
        (
            f"{EB}::test_dropout_trains_as_one_device_on_any_device_count",
            f"{EB}::test_a_checkpoint_of_4_devices_resumes_on_3_as_the_same_run",
        ),
    ),
    # ------------------------------------------------------------------ mixed precision
    Mutant(
        "loss_scale_not_halved_on_overflow",
        ENGINE,
        "a step whose gradient overflows is skipped by the non-finite guard (which float16 requires) and halves the scale",
        "an overflow leaves the loss scale as it was, so every later step overflows too",
        (_p("jddp.engine.loss_scale:adjusted", ("jnp.maximum(state.scale / 2, MIN_SCALE)", "state.scale")),),
        (f"{LS}::test_the_loss_scale_follows_gradscalers_rule",),
    ),
    Mutant(
        "loss_scale_grows_one_step_late",
        ENGINE,
        "2000 finite steps in a row double it",
        "the scale doubles after 2001 finite steps (an off-by-one in the growth interval)",
        (_p("jddp.engine.loss_scale:adjusted", ("grow = good >= GROWTH_INTERVAL", "grow = good > GROWTH_INTERVAL")),),
        (f"{LS}::test_the_loss_scale_follows_gradscalers_rule",),
    ),
    Mutant(
        "overflowing_float16_step_applied",
        ENGINE,
        "a step whose gradient overflows is skipped by the non-finite guard",
        "under loss scaling a step whose scaled gradient overflowed is applied (the scale still halves)",
        (_p(f"{STEP}._apply", ("take = take & finite", "take = take & (finite | opts.loss_scaled)")),),
        (f"{BB}::test_compute_dtype_float16_scales_the_loss_and_halves_the_scale_on_overflow",),
    ),
    Mutant(
        "gradients_returned_in_the_compute_dtype",
        ENGINE,
        "params, gradients and optimizer state stay float32",
        "the gradients of a bfloat16/float16 pass are kept in that dtype and all-reduced in it",
        (
            _p(
                f"{STEP}._local_grads",
                (
                    "return grads, new_model_state, (loss_w, count, aux_w)",
                    "return (grads if self.options.compute_dtype is None else self._cast(grads)), new_model_state, (loss_w, count, aux_w)",
                ),
            ),
        ),
        (f"{LS}::test_gradients_of_a_narrow_forward_pass_are_all_reduced_in_the_parameters_dtype",),
    ),
    # ------------------------------------------------------------------ the heap trimmer
    Mutant(
        "trimmer_never_trims",
        MEMORY,
        "``Trimmer.maybe`` calls glibc's ``malloc_trim(0)``",
        "the trimmer counts a trim but never calls malloc_trim: the fragmented heap stays resident",
        (_p("jddp.runtime.memory:Trimmer.maybe", ("self._trim(0)", "pass")),),
        (
            "tests/test_memory_trimmer.py::test_the_trimmer_calls_malloc_trim_at_most_once_every_interval",
            "tests/test_leaks.py::test_trimmer_returns_a_fragmented_heap",
        ),
    ),
    Mutant(
        "trimmer_trims_at_every_call",
        MEMORY,
        "at most once every ``TRIM_EVERY_S`` seconds",
        "the trimmer trims at every call (every step), not once a minute",
        (
            _p(
                "jddp.runtime.memory:Trimmer.maybe",
                ("if self._trim is None or now - self._last < self.every:", "if self._trim is None:"),
            ),
        ),
        (
            "tests/test_memory_trimmer.py::test_the_trimmer_calls_malloc_trim_at_most_once_every_interval",
            "tests/test_leaks.py::test_trimmer_returns_a_fragmented_heap",
        ),
    ),
    # ------------------------------------------------------------------ contracts of the user's callables
    Mutant(
        "hook_gradients_not_guarded",
        ENGINE,
        "The non-finite guard reads what is applied: the loss, the averaged gradient and the gradients the hook returned",
        "the guard reads the gradient before grad_hook only: a hook returning NaN makes every parameter NaN",
        (_p(f"{STEP}._apply", ("finite = finite & contracts.finite(grads_sum)", "finite = finite")),),
        (f"{CT}::test_a_grad_hook_that_returns_nan_is_caught_by_the_guard",),
    ),
    Mutant(
        "hook_gradient_of_another_shape_broadcast",
        ENGINE,
        "`grad_hook`'s gradients with the tree, shapes and dtypes it got",
        "a tree_like result's leaf shapes are not checked: a hook's scalar gradient is broadcast into the update",
        (_p("jddp.engine.contracts:_check_tree_like", ("if jnp.shape(x) != jnp.shape(old):", "if False:")),),
        (f"{CT}::test_a_violation_is_refused_naming_the_callable_the_leaf_and_the_expectation",),
    ),
    Mutant(
        "integer_loss_trained_with_a_zero_gradient",
        ENGINE,
        "the loss a float scalar (an integer loss has no gradient and is refused)",
        "a loss of an integer or bool dtype is accepted (cast to float: a zero gradient)",
        (
            _p(
                "jddp.engine.contracts:_check_dtype",
                ('if contract.dtypes == "float" and _kind(dtype) != "float":', "if False:"),
            ),
        ),
        (f"{CT}::test_a_violation_is_refused_naming_the_callable_the_leaf_and_the_expectation",),
    ),
    Mutant(
        "metric_named_like_jddps_overwrites_it",
        ENGINE,
        "metrics a dict of scalars under names jddp does not report itself",
        "a user metric under a reserved name is accepted (eval without eval_fn: 'loss' overwrites the loss)",
        (
            _p(
                "jddp.engine.contracts:check_metrics",
                ("if name in contract.reserved or name.startswith(contract.prefixes):", "if False:"),
            ),
        ),
        (f"{CT}::test_a_metric_named_like_jddps_is_refused_in_eval_without_eval_fn",),
    ),
    Mutant(
        "loss_without_params_silent",
        ENGINE,
        "A loss that does not depend on `params` (every gradient a constant zero) is warned about.",
        "a loss computed from parameters in a closure trains with a zero gradient, silently",
        (_p("jddp.engine.contracts:warn_if_constant", ("if grads_constant and all(grads_constant):", "if False:")),),
        (f"{CT}::test_a_loss_that_does_not_depend_on_params_warns",),
    ),
    # ------------------------------------------------------------------ model state under accumulation
    Mutant(
        "micro_batches_contiguous",
        ENGINE,
        "micro-batch `i` of a step holds the global rows `j` with `j % k == i`",
        "each device's micro-batch i is its i-th block of consecutive rows: another set of examples on each layout",
        (
            _p(
                "jddp.engine.step:micro_batches",
                (
                    "return jnp.swapaxes(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 0, 1)",
                    "return x.reshape(k, x.shape[0] // k, *x.shape[1:])",
                ),
            ),
        ),
        (
            f"{AC}::test_a_running_mean_kept_per_device_ends_as_one_devices_under_accumulation",
            f"{AC}::test_synchronised_batchnorm_under_accumulation_trains_alike_on_1_2_4_and_8_devices",
        ),
    ),
    Mutant(
        "micro_batch_draws_contiguous",
        ENGINE,
        "(micro-batch `i` holds the global rows `j % k == i`: on device `d`, rows `d * k * m + i + k * t` for `t < m`)",
        "each micro-batch keeps the draws of a block of consecutive rows while it holds every k-th row",
        (
            _p(
                "jddp.engine.rng:_Rewrite._draw",
                (
                    "return lax.dynamic_index_in_dim(strided, self.micro, axis=1, keepdims=False)",
                    "return lax.dynamic_slice_in_dim(device, self.micro * self.rows, self.rows, 0)",
                ),
            ),
        ),
        (f"{EB}::test_dropout_trains_as_one_device_on_any_device_count",),
    ),
    Mutant(
        "another_runs_snapshot_restored",
        CKPT,
        "A snapshot of another run is never restored (a warning names both runs) and is removed",
        "a snapshot's run id and config fingerprint are not compared: a new run at a stopped run's path restores "
        "the stopped run's weights from memory",
        (
            _p(
                "jddp.checkpoint.snapshot_format:_decode",
                ('if header.get("run") != run or header.get("fingerprint") != fingerprint:', "if False:"),
            ),
        ),
        (f"{ID}::test_a_new_run_at_a_stopped_runs_path_does_not_restore_its_snapshots",),
    ),
    Mutant(
        "checkpointers_share_orbax_barriers",
        CKPT,
        "each one's Orbax barriers carry its own prefix",
        "every Checkpointer's Orbax manager waits at Orbax's unprefixed barriers: two managers' background writes "
        "meet at one barrier",
        (
            _p(
                "jddp.checkpoint.orbax_io:manager_options",
                ("barrier_sync_key_prefix=barrier_prefix", "barrier_sync_key_prefix=None"),
            ),
        ),
        (
            f"{SBS}::test_two_open_checkpointers_wait_at_barriers_of_different_names",
            f"{SBS}::test_two_checkpointers_save_every_step_for_20_steps_in_two_processes",
        ),
    ),
    Mutant(
        "existing_step_kept_silently",
        CKPT,
        "is never kept silently",
        "a step the directory holds from another run is skipped without a word, whatever on_existing says",
        (
            _p(
                "jddp.checkpoint.saving:Saving._may_write",
                ("    others = sorted(", "    return False\n    others = sorted("),
            ),
        ),
        (f"{EX}::test_an_existing_step_from_another_run_is_never_kept_silently",),
    ),
)

# The seven invariants of the design: each is (doc file, its sentence); each must be the quote of a mutant.
CORE: tuple[tuple[str, str], ...] = (
    (README, "Gradients and metrics are the **exact** mean over the real (unmasked) examples of the global batch"),
    (
        GLOSSARY,
        "Under `check_vma=False` the gradient is the device's own, and jddp all-reduces exactly once, explicitly",
    ),
    (GLOSSARY, "Gradients, loss and metric totals, counts and unsynchronised model state travel in one all-reduce op"),
    (
        GLOSSARY,
        "`DDP(model)` (broadcasts rank 0's weights) | `dp = jddp.DataParallel(loss_fn, optimizer, "
        "mesh=jddp.data_mesh())`; `dp.init(params)` replicates",
    ),
    (ENGINE, "Model state computed per device without an axis name is averaged over replicas after each step"),
    (
        SAMPLER,
        "the sequence of global batches depends on ``(dataset_size, seed, shuffle, drop_last, global_batch_size)`` "
        "only, never on ``num_replicas``",
    ),
    (CKPT_MD, "the complete state (parameters, optimizer, model state, RNG, step) plus the loader's global position"),
)


def normalised(text: str) -> str:
    """``text`` with Python's docstring indentation and line breaks folded into single spaces."""
    return " ".join(text.split())


def doc_text(doc: str) -> str:
    return normalised((ROOT / doc).read_text())


def doc_guarantees() -> list[tuple[str, str]]:
    """Every documented guarantee, read from the docs: ``(doc file, its text)`` for each item of

    * the glossary's "What is different from DDP, and why" (its bold items);
    * the engine guide's "Options" list;
    * the sampler's "Guarantees:" list;
    * the Checkpointer manual's "Guarantees:" list (its bold items).
    """
    items: list[tuple[str, str]] = []

    def bullets(doc: str, block: str) -> None:
        for item in re.split(r"\n\s*[-*] ", "\n" + block)[1:]:
            items.append((doc, normalised(item)))

    glossary = (ROOT / GLOSSARY).read_text().split("## What is different from DDP, and why", 1)[1]
    bullets(GLOSSARY, glossary.split("\n\nThe facts", 1)[0])
    options = (ROOT / ENGINE).read_text().split("## Options", 1)[1]
    bullets(ENGINE, options.split("\n\n`dp.check_replicas", 1)[0])
    sampler = (ROOT / SAMPLER).read_text().split("Guarantees:", 1)[1]
    bullets(SAMPLER, sampler.split("\n\nProvenance:", 1)[0])
    ckpt = (ROOT / CKPT).read_text().split("Guarantees:", 1)[1]
    bullets(CKPT, ckpt.split('"""', 1)[0])
    return items


# ---------------------------------------------------------------------------------------------- applying


def by_name(name: str) -> Mutant:
    for mutant in MUTANTS:
        if mutant.name == name:
            return mutant
    raise KeyError(f"No semantic mutant named {name!r}; the names are in tests/semantic_mutants.py: "
                   f"{', '.join(m.name for m in MUTANTS)}.")  # fmt: skip


def _resolve(target: str):
    module_name, qualname = target.split(":")
    module = importlib.import_module(module_name)
    *owners, attr = qualname.split(".")
    owner = module
    for part in owners:
        owner = getattr(owner, part)
    return module, owner, attr


def _plain(obj):
    return obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj


def _patched(patch: Patch, module, original) -> object:
    func = _plain(original)
    source = textwrap.dedent(inspect.getsource(func))
    for old, new in patch.edits:
        count = source.count(old)
        if count != 1:
            raise ValueError(f"Semantic mutant patch of {patch.target}: {old!r} occurs {count} times in its source "
                             "(expected once); the source changed, update the mutant.")  # fmt: skip
        source = source.replace(old, new)
    flags = __future__.annotations.compiler_flag
    code = compile(source, f"<semantic mutant of {patch.target}>", "exec", flags=flags, dont_inherit=True)
    namespace: dict = {}
    exec(code, module.__dict__, namespace)  # globals: the module's own, so its names resolve as before
    return namespace[func.__name__]


def apply(mutant: Mutant) -> Callable[[], None]:
    """Applies ``mutant``'s patches; returns the function that undoes them."""
    undo: list[tuple[object, str, object]] = []
    for patch in mutant.patches:
        module, owner, attr = _resolve(patch.target)
        original = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        if isinstance(patch, Patch):
            new = _patched(patch, module, original)
            if isinstance(original, (staticmethod, classmethod)):
                new = type(original)(new)
        else:
            new = patch.make(original)
        undo.append((owner, attr, original))
        setattr(owner, attr, new)
        if not isinstance(owner, type):  # a module function: every ``from module import name`` too
            for other in list(sys.modules.values()):
                if getattr(other, "__name__", "").startswith("jddp") and other is not owner:
                    for key, value in list(vars(other).items()):
                        if value is original:
                            undo.append((other, key, original))
                            setattr(other, key, new)

    def revert() -> None:
        for owner, attr, original in reversed(undo):
            setattr(owner, attr, original)

    return revert


def apply_from_env() -> Mutant | None:
    """Applies the mutant named by ``$JDDP_SEMANTIC_MUTANT``, if any (for processes that tests start)."""
    name = os.environ.get(ENV)
    if not name:
        return None
    mutant = by_name(name)
    apply(mutant)
    return mutant


# ---------------------------------------------------------------------------------------------- the plugin


def pytest_configure(config) -> None:
    mutant = apply_from_env()
    if mutant is not None:
        config._semantic_mutant = mutant
        sys.stderr.write(f"semantic mutant applied: {mutant.name}\n")  # seen under -q too (the runner reads it)


def pytest_report_header(config) -> str | None:
    mutant = getattr(config, "_semantic_mutant", None)
    return None if mutant is None else f"semantic mutant applied: {mutant.name} ({mutant.bug})"
