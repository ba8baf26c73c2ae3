"""Who gets which prompts: a volunteer's first request and every lease after it.

  handshake.py   `HandshakeDesk`: the info stream, run id, version gate and newest pointer
  taskboard.py   `TaskBoard`: prompt leases, expiry, re-leasing, poison-prompt retirement
  leasing.py     `LeaseDesk`: lease requests and renewals, back-pressure on in-flight work, fair share
  sync_round.py  `SyncRound`: the synchronous baseline (`--sync`)
  quorum.py      `VolunteerQuorum`: hold the first step until N volunteers are in
  preflight.py   start-up checks of the config against the model and the task source

Imports nothing else of coordinator/.
"""
