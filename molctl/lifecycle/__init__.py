"""The stack's lifecycle: what `up`, `switch`, `down`, `status` and `reload` do.

`start` (up: preflight, claims, spawn through `starter`, record, wait until ready; `starthistory`
keeps each start's phase times for the ETA), `switch`, `stop` (down), `status`, `reload`;
`launch` (the engine's and the proxy's argv, what up spawns and render writes), `readiness` and
`waitready` (the readiness wait, also systemd's step), `stacks` (what runs, read-only), `canary`
(the adapter efficacy canary), `progress` and `stopsignals` (reporting and interruption)."""
