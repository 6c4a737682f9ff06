"""What the three trainers share (package-private).

- `privacy_plan`: the target-ε plan (calibrated at the first fit, refused
  past its steps, adopted on load), the budget check and the fit-argument
  refusal;
- `private_state`: the step counter and the noise seeds;
- `frozen_settings`, `optimizer_restore`: settings fixed at construction,
  an optimizer restored with its state;
- `data_parallel`: the engines a DP-SGD step runs under, the devices a
  batch splits over, each host's rows; `hosts_agreement`: what the hosts
  of a multi-host job compare (models, settings, every step's batch);
- `device_rows`: training rows kept on the device;
- `layer_taps`: the one walk over a model's layers, and taps on their
  outputs;
- `backends`: per-backend gradient and replica plumbing.
"""
