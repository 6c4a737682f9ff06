"""`ConfigDataclass`: the config round trip of a frozen settings dataclass.

Settings such as `AdaptiveClipping` and `LossRelease` are saved in a
model's config as a dict and given back to the model's constructor,
which takes either the object or that dict.

Example:

>>> import dataclasses
>>> @dataclasses.dataclass(frozen=True)
... class Demo(ConfigDataclass):
...     config_argument = "demo"
...     size: int = 1
>>> Demo.from_config(Demo(3).get_config())
Demo(size=3)
>>> Demo.from_config(2)
Traceback (most recent call last):
...
TypeError: demo must be a kdpemb.privacy.Demo (or its config dict), got int.
"""

import dataclasses
from typing import ClassVar


class ConfigDataclass:
    """Mixin of a frozen dataclass: `get_config` and `from_config`.

    `config_argument` names the argument that takes it, for the error.
    """

    config_argument: ClassVar[str] = "settings"

    def get_config(self):
        """A JSON-ready dict; `from_config` rebuilds the settings from it."""
        return dataclasses.asdict(self)

    @classmethod
    def from_config(cls, config):
        """The settings from an instance (returned as is) or its config dict."""
        if isinstance(config, cls):
            return config
        if not isinstance(config, dict):
            raise TypeError(
                f"{cls.config_argument} must be a kdpemb.privacy.{cls.__name__} "
                f"(or its config dict), got {type(config).__name__}."
            )
        return cls(**config)
