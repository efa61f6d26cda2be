"""otel-swa as a plugin of the engines' own plugin frameworks: install the package, set one variable.

Two entry points, both named ``otel_swa``, installed with the ``otel-swa`` distribution:

================================  ==================================  ==========================================
group                             function                            called by
================================  ==================================  ==========================================
``sglang.srt.plugins``            :func:`load_sglang`                 ``sglang.srt.plugins.load_plugins()``
                                                                      (sglang 0.5.23): the ``Engine`` and
                                                                      ``launch_server`` main process, every
                                                                      scheduler, the detokenizer and the
                                                                      data-parallel controller
``vllm.general_plugins``          :func:`load_vllm`                   ``vllm.plugins.load_general_plugins()``
                                                                      (vllm 0.33): the API server or ``LLM``
                                                                      process, the engine core, every worker
================================  ==================================  ==========================================

SGLang's ``SGLANG_PLUGINS`` and vLLM's ``VLLM_PLUGINS`` (comma-separated entry-point names; unset:
every installed plugin) decide whether the engine loads it at all: name ``otel_swa`` there when the
variable is set.

The switch is otel-swa's usual one, read in each process: ``OTEL_SWA_DIVERGENCE_INTERVAL``, or,
when it is unset, SGLang's own ``SGLANG_KV_CANARY_SWA_DIVERGENCE_STATS_INTERVAL``
(:func:`otel_swa.config.divergence_interval`). Unset or 0: the plugin reads the variable and
returns; nothing is imported beyond :mod:`otel_swa.config`, nothing is wrapped and OpenTelemetry
is not touched. Set: the process is instrumented exactly as ``opentelemetry-instrument`` would
instrument it with the ``swa_sglang`` or ``swa_vllm`` instrumentor
(:mod:`opentelemetry.instrumentation.swa_plugins.activate`), with OpenTelemetry set up from the
standard ``OTEL_*`` variables as the distro would set it up
(:func:`otel_swa.telemetry.setup.configure_like_the_distro`; none set: otel-swa's line in the
engine's own log). Where ``opentelemetry-instrument`` already instrumented the process, the plugin
does nothing more: nothing is wrapped or set up twice.

An unusable value of the variable is logged once per process tree, and nothing is instrumented.
"""

from __future__ import annotations

__all__ = ["load_sglang", "load_vllm", "switched_on"]


def switched_on() -> bool:
    """Whether the interval variable asks for the reporter in this process (an interval > 0).
    An unusable value is logged (once per process tree) and counts as off."""
    from otel_swa import config

    try:
        return config.divergence_interval() > 0
    except config.ConfigError as exc:
        if config.warn_once("otel_swa_plugin"):
            import logging

            logging.getLogger(__name__).error("otel-swa: %s; the engine is not instrumented", exc)
        return False


def load_sglang() -> None:
    """Entry point of group ``sglang.srt.plugins`` (module docstring). Run by SGLang's
    ``load_plugins()``, which applies the hooks registered here right after."""
    if switched_on():
        from opentelemetry.instrumentation.swa_plugins.activate import activate

        activate("sglang")


def load_vllm() -> None:
    """Entry point of group ``vllm.general_plugins`` (module docstring). Run by vLLM's
    ``load_general_plugins()`` in every process of the engine."""
    if switched_on():
        from opentelemetry.instrumentation.swa_plugins.activate import activate

        activate("vllm")
