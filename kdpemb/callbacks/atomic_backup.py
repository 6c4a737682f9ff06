"""AtomicBackupAndRestore: Keras' BackupAndRestore, with atomic saves."""

import json
import os
import shutil

import keras

from kdpemb import _atomic, distribute, saving


class AtomicBackupAndRestore(keras.callbacks.BackupAndRestore):
    """`keras.callbacks.BackupAndRestore` whose backups are written atomically.

    Keras writes the backup weights into the previous backup file, so a
    process killed while saving leaves a truncated file that the restart
    cannot load. This subclass writes the weights and the training metadata
    each to a temporary file and `os.replace`s it (`kdpemb.saving`): a kill
    at any point leaves the previous backup or the new one. The weights are
    replaced first; a kill before the metadata follows leaves new weights
    (their `private_steps` included) with the previous epoch number, from
    which Keras reruns that epoch. Arguments and restoring are Keras';
    `backup_dir` must be a local directory. On several hosts
    (`kdpemb.distribute`) only the chief writes and deletes the backup, and
    every host restores from it: give them one shared directory.

    Use it with `kdpemb.callbacks.PrivacyLedger` after it, so that steps
    run after the last backup are still counted:

        callbacks=[AtomicBackupAndRestore(backup_dir, save_freq=k),
                   PrivacyLedger(ledger_path), PrivacyBudget(...)]

    Example:

    >>> import tempfile
    >>> import keras
    >>> import kdpemb
    >>> with tempfile.TemporaryDirectory() as directory:
    ...     backup = kdpemb.callbacks.AtomicBackupAndRestore(directory)
    >>> isinstance(backup, keras.callbacks.BackupAndRestore)  # same arguments
    True
    """

    def _save_model(self):
        chief = saving.writes_here(self.model)  # Writes every file here.
        if self.double_checkpoint and chief:
            for source, copy in (
                (self._weights_path, self._prev_weights_path),
                (self._training_metadata_path, self._prev_training_metadata_path),
            ):
                if os.path.exists(source):
                    with _atomic.atomic_path(copy) as temporary:
                        shutil.copyfile(source, temporary)
        saving.save_weights(self.model, self._weights_path, overwrite=True)
        if not chief:
            return
        _atomic.write_text(
            self._training_metadata_path,
            json.dumps({"epoch": self._current_epoch, "batch": self._last_batch_seen}),
        )

    def on_train_begin(self, logs=None):
        hosts = distribute.current_hosts(self.model)
        # A host that cannot restore stops every host (not one left waiting).
        with hosts.together("restoring the backup"):
            if hosts.is_chief:
                super().on_train_begin(logs)
            else:  # Restores the chief's backup; only the chief repairs one.
                self._load_model()

    def on_train_end(self, logs=None):
        if saving.writes_here(self.model):  # The chief deletes the backup.
            super().on_train_end(logs)
