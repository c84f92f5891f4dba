"""The command-line programs and what only they use, apart from the library in :mod:`tpipe.train`.

Each program is ``python -m tpipe.train.cli.<name>`` (the trainer also ``python -m tpipe.train``):
:mod:`.trainer`, :mod:`.report`, :mod:`.autotune`, :mod:`.evaluate`, :mod:`.generate`,
:mod:`.export` and :mod:`.write_corpus`. Behind them: start-up and error handling
(:mod:`.startup`), a config's help (:mod:`.config_help`), a config translated to an experiment
(:mod:`.experiment`) and its task (:mod:`.tasks`), the step log (:mod:`.step_log`,
:mod:`.metrics`, :mod:`.throughput`), what a config costs (:mod:`.report`'s library,
:mod:`.report_text`, :mod:`.schedule_summary`, :mod:`.communication`, :mod:`.multislice`) and
the auto-tuner's candidates (:mod:`.search_space`). The programs reach the engine through the
public API only (``tpipe``, ``tpipe.training``, ``tpipe.schedules``, ``tpipe.tools``), never
``tpipe.core``.
"""
