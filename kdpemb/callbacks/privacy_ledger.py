"""PrivacyLedger: a write-ahead step count, so a killed fit loses no step."""

import os

import keras

from kdpemb import distribute
from kdpemb.privacy import ledger
from kdpemb.privacy.protocol import (
    check_private_model,
    read_private_steps,
    resume_steps,
)


def executed_steps(params, begin, end):
    """The steps of an execution that Keras reports from batch `begin` to
    `end` (its first and last step: a whole `steps_per_execution`), where
    the last one of an epoch of `params["steps"]` ends with the epoch. One
    that ran on into the next epoch's data (a fit given `steps_per_epoch`)
    is counted in full at the epoch's end, where the model is synced.

    >>> executed_steps({"steps": 8}, 6, 8), executed_steps({"steps": 8}, 3, 5)
    (2, 3)
    """
    ran = end - begin + 1
    per_epoch = (params or {}).get("steps")
    if per_epoch:
        ran = min(ran, int(per_epoch) - begin)
    return max(1, ran)


class PrivacyLedger(keras.callbacks.Callback):
    """Counts every private step on disk before it runs, and resumes from it.

    A checkpoint every k steps (`keras.callbacks.BackupAndRestore(
    save_freq=k)`) restores a `private_steps` that leaves out the steps run
    after it, though what they released may have been seen. This callback
    closes the gap with a write-ahead ledger (`kdpemb.privacy.ledger`):

    - before each execution of `train_step` (`on_train_batch_begin`) it
      atomically rewrites the ledger file with the number of private steps
      that will then have begun, so a kill at any point leaves a count that
      is never below the steps that ran (with `steps_per_execution` = k, k
      more; with a target-ε plan, at most its planned steps, since a
      kdpemb model's step past its plan counts nothing and releases
      nothing);
    - when training begins it raises the model's `private_steps` to the
      ledger's count if a restore went back (it never lowers it) and says
      so. A `FedEmbModel` on rounds without sampling (`sampling="epochs"`)
      is raised to the next whole epoch: its accounting counts epochs of
      R rounds, and the killed epoch's rounds released part of one.
      `private_steps` is what `PrivacyBudget`, `privacy_statement` and
      target-ε plans read, so from then on they count the lost steps;
    - at each epoch end and at train end, where every backend has synced
      the model, it writes the model's own count (exact: a call of
      `train_step` that added 0 read no private data).

    Put it after `BackupAndRestore` (whose `on_train_begin` restores the
    weights) and before `PrivacyBudget`; a fit whose `private_steps` goes
    below the ledger's count after this callback began is refused before
    its first step. The ledger records the model's class and its
    mechanism's parameters, and refuses a model of another class or
    mechanism; a ledger that keeps a plan also refuses a model with a
    fixed noise, and a restored `private_steps` above its count (a backup
    of another run: the ledger counts each step of its own run before it
    runs). Give each training run its own path, and keep it after the
    run (it is the record of what the run spent;
    `kdpemb.privacy.ledger_statement` states it even if the run is never
    resumed). A model with a `target_epsilon` hands its plan to the
    ledger (`plan`), which keeps it with the count: the same script run
    again after a kill builds a model that adopts that plan (the same
    noise, the same planned steps) and finishes it, the steps the killed
    run began counted, the epoch Keras reruns cut short at the plan's end
    (`kdpemb.privacy.ledger.plan_arguments` rebuilds the model's
    arguments from the file). Each private step costs one small atomic
    file write: about 10 ms with `durable=True` (fsync) and 0.7 ms without
    on a container's overlay disk, less on a local SSD. On several hosts
    (`kdpemb.distribute`) the chief alone reads and writes the ledger and
    shares its count: give every host the same path. A rerun's model reads
    the plan on every host, so keep the file where every host sees it (a
    shared disk): hosts that adopt different plans are refused together
    before any round.

    Args:
        path: str or path. The ledger file (JSON), e.g. next to the backup.
        durable: bool. True (default): each write is fsynced, so the ledger
            also survives a power loss or an OS crash. False: it survives
            a killed process (SIGKILL, out of memory), which is what
            `BackupAndRestore` is for, at a fraction of the cost.
        verbose: int. 1 prints when the ledger raises `private_steps`.

    Attributes:
        restored_steps: int. The steps this fit's start added to
            `private_steps` from the ledger (0 when nothing was lost).
        plan: dict or None. The target-ε plan written with the count from
            the fit's first step on (`kdpemb.privacy.ledger.plan_record`),
            set by a kdpemb model's `fit`; None keeps the plan the file
            already holds, if any.

    Example:

    >>> import os, tempfile, kdpemb
    >>> model = kdpemb.testing.ToyDPRegressor(
    ...     num_examples=64, num_features=3, noise_multiplier=1.5,
    ...     sampling_probability=0.1)
    >>> model.compile(optimizer="sgd")
    >>> data = kdpemb.testing.toy_regression_data(64, 3, steps_per_epoch=4)
    >>> path = os.path.join(tempfile.mkdtemp(), "ledger.json")
    >>> ledger = kdpemb.callbacks.PrivacyLedger(path)
    >>> _ = model.fit(data, epochs=2, verbose=0, callbacks=[ledger])
    >>> kdpemb.privacy.ledger.read_ledger(path)["steps"]
    8
    >>> _ = model.private_steps.assign(5)  # As a restored checkpoint would.
    >>> _ = model.fit(data, epochs=1, verbose=0, callbacks=[ledger])
    PrivacyLedger: the model restored 5 private steps, but the ledger ... 8.
    >>> kdpemb.privacy.protocol.read_private_steps(model)
    12
    """

    def __init__(self, path, durable=True, verbose=1):
        super().__init__()
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(
                f"path must be a file path (str or os.PathLike), got "
                f"{type(path).__name__}."
            )
        self.path = os.fspath(path)
        if os.path.isdir(self.path):
            raise ValueError(
                f"path={self.path!r} is a directory; PrivacyLedger needs a file "
                "path, e.g. os.path.join(backup_dir, 'privacy_ledger.json')."
            )
        self.durable = bool(durable)
        self.verbose = verbose
        self.restored_steps = 0
        self.plan = None
        self._recorded_plan = None
        self._mechanism = None
        self._record = None
        self._floor = 0
        self._counted = 0
        self._batch_begin = 0
        self._hosts = distribute.Hosts.single()

    def on_train_begin(self, logs=None):
        model = self.model
        self._mechanism = check_private_model(model)
        self._hosts = distribute.current_hosts(model)
        steps = read_private_steps(model)
        recorded = self._read_on_chief(steps)
        self.restored_steps = 0
        counted = steps if recorded is None else max(recorded, steps)
        raised = steps if recorded is None else resume_steps(model, counted)
        if raised > steps:
            self.restored_steps = raised - steps
            if self.verbose:
                whole = (
                    ""
                    if raised == counted
                    else f" (the model accounts {raised} for them)"
                )
                print(
                    f"PrivacyLedger: the model restored {steps} private steps, "
                    f"but the ledger {self.path} counts {counted} "
                    f"begun{whole}; private_steps is raised to {raised}.",
                    flush=True,
                )
            model.private_steps.assign(raised)
            steps = raised
        # The file's plan until the first step: a fit refused at train
        # begin (after this callback) leaves the plan it found.
        self._record = ledger.ledger_record(
            self._mechanism, steps, self._model_name(), self._recorded_plan
        )
        self._floor = self._counted = steps
        self._write(steps)

    def on_epoch_begin(self, epoch, logs=None):
        # Synced on every backend: nothing may have lowered the count.
        self._counted = self._checked_steps()

    def on_train_batch_begin(self, batch, logs=None):
        self._batch_begin = batch
        if self.plan is not None and self._record.get("plan") != self.plan:
            # Kept from the first step of a fit its guard accepted.
            self._record["plan"] = ledger.check_plan_record(self.plan)
        size = max(1, int(getattr(self.model, "steps_per_execution", 1) or 1))
        # k: an execution may run on into the next epoch's data (a fit
        # given steps_per_epoch), so it is not cut at the epoch's end here.
        self._write(self._within_plan(self._counted + size))

    def on_train_batch_end(self, batch, logs=None):
        ran = executed_steps(self.params, self._batch_begin, batch)
        self._counted = self._within_plan(self._counted + ran)

    def on_epoch_end(self, epoch, logs=None):
        self._sync()

    def on_train_end(self, logs=None):
        self._sync()

    # Helpers.

    def _model_name(self):
        return type(self.model).__name__

    def _read_on_chief(self, steps):
        """The ledger's step count, or None: read by the chief and shared,
        so every host raises `private_steps` alike (and a refusal stops
        every host). `steps`: the model's restored `private_steps`."""
        code = 0  # 0: no ledger, 1: refused, 2 + n: n steps.
        refusal = None
        self._recorded_plan = None  # Kept by the chief, the one writer.
        if self._hosts.is_chief:
            try:
                record = ledger.read_ledger(
                    self.path, self._mechanism, self._model_name()
                )
            except Exception as error:  # Shared below, then re-raised.
                if self._hosts.count == 1:
                    raise
                code, refusal = 1, error
            else:
                if record is not None:
                    self._check_resumable(record, steps)
                    self._recorded_plan = record.get("plan")
                code = 0 if record is None else 2 + record["steps"]
        code = self._hosts.broadcast_int(code)
        if code == 1:
            if refusal is not None:
                raise refusal
            raise ValueError(
                f"The chief refused the privacy ledger {self.path} (its error "
                "says why); nothing was trained."
            )
        return None if code == 0 else code - 2

    def _write(self, steps):
        self._record["steps"] = int(steps)
        if self._hosts.is_chief:  # One host writes the shared ledger.
            ledger.write_record(self.path, self._record, self.durable)

    def _check_resumable(self, record, steps):
        """Refuses a model that the plan a ledger keeps does not account
        for: one with a fixed noise, or restored with more steps than the
        ledger counts."""
        plan = record.get("plan")
        if plan is None:
            return
        cls = self._model_name()
        arguments = f"**kdpemb.privacy.ledger.plan_arguments({self.path!r})"
        if getattr(self.model, "target_epsilon", None) is None:
            raise ValueError(
                f"The privacy ledger {self.path} keeps the target-ε plan "
                f"(target_epsilon={plan['target_epsilon']}, planned_steps="
                f"{plan['planned_steps']}) of the run whose {record['steps']} "
                f"steps it counts; this {cls} has a fixed noise_multiplier, "
                "whose steps that plan does not bound. Resume the run as it "
                f"was built (the same script, or {cls}(..., {arguments})); a "
                "run with a fixed noise needs its own ledger path."
            )
        if steps > record["steps"]:
            raise ValueError(
                f"This {cls} was restored with {steps} private steps "
                "(keras.callbacks.BackupAndRestore?), more than the "
                f"{record['steps']} that the privacy ledger {self.path} counts "
                "for the plan it keeps: the ledger counts every step of its "
                "run before it runs, so the backup is not of that run (one left "
                "by another run?) and its steps are not in the plan. Nothing "
                "was trained. Resume with the backup directory of the run "
                "this ledger counts, or start a new run with a new ledger path "
                "and an empty backup directory."
            )

    def _within_plan(self, steps):
        """`steps`, at most the planned steps of the plan written (a
        kdpemb model counts no step past its plan), never below the steps
        counted."""
        plan = (self._record or {}).get("plan")
        if plan is None:
            return steps
        return max(self._counted, min(steps, plan["planned_steps"]))

    def _checked_steps(self):
        steps = read_private_steps(self.model)
        if steps < self._floor:
            raise RuntimeError(
                f"{self._model_name()}.private_steps went down to {steps} after "
                f"PrivacyLedger counted {self._floor} private steps: a callback "
                "after PrivacyLedger restored an older checkpoint. Put "
                "PrivacyLedger after keras.callbacks.BackupAndRestore in the "
                "callbacks list."
            )
        return steps

    def _sync(self):
        if self._mechanism is None:
            return
        self._counted = self._checked_steps()
        self._write(self._counted)
