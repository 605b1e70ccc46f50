# ruff: noqa: E501  (a table of source snippets, kept on one line each so they can be read against the source)
"""New semantic mutants (issue 42), in ``tests/semantic_mutants.py``'s format, for the lead to merge into it.

Mixed precision (the loss scale's update and its skip of a non-finite step, gradients returned in the parameters'
dtype), the heap trimmer, the contracts of the user's callables (``jddp.engine.contracts``) and the micro-batch
rule under accumulation. ``micro_batch_draws_contiguous`` replaces ``micro_batch_draws_at_the_device_offset``,
whose patch and quote no longer exist since micro-batches are strided.

Until merged, importing this module adds its mutants to the registry; run them with the registry's runner:

    PYTEST_PLUGINS=tests.semantic_mutants_new python -m tests.semantic_mutants_new [NAME ...]
"""

from __future__ import annotations

import runpy
import sys

from tests import semantic_mutants as registry
from tests.semantic_mutants import Mutant, _p

ENGINE = registry.ENGINE
STEP = registry.STEP
MEMORY = "jddp/runtime/memory.py"
BB = "tests/test_between_backward_and_update.py"
LS, CT, AC = "tests/test_engine_loss_scale.py", "tests/test_engine_contracts.py", "tests/test_engine_accumulation.py"
EB = registry.EB

MUTANTS: tuple[Mutant, ...] = (
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
)

REPLACES = ("micro_batch_draws_at_the_device_offset",)  # to drop from the registry when merging

if not any(m.name == MUTANTS[0].name for m in registry.MUTANTS):  # imported as a plugin and by the runner: once
    registry.MUTANTS = tuple(m for m in registry.MUTANTS if m.name not in REPLACES) + MUTANTS


if __name__ == "__main__":  # the registry's runner over these mutants (all of them unless named)
    names = [a for a in sys.argv[1:] if not a.startswith("-")]
    flags = [a for a in sys.argv[1:] if a.startswith("-")]
    sys.argv = [sys.argv[0], *flags, *(names or [m.name for m in MUTANTS])]
    runpy.run_path(str(registry.ROOT / "tools" / "semantic_mutants.py"), run_name="__main__")
