"""The trajectory inspector: server-rendered HTML pages of the store, under ``/ui``.

- ``/ui/sessions``: the sessions, filtered (run, group, policy, status, kind, reward range,
  policy version, creation time), sorted and paged by keyset: one SQL statement a page
  (``queries.py``).
- ``/ui/sessions/{id}``: one session's tree of chains, each turn's messages beside the prompt
  tokens the model saw and its generated tokens coloured by logprob or by policy version,
  its tool calls, reasoning and rewards (``session_view.py``); its completions are one query.
- ``/ui/run``: a run's reward and held-out curves, versions and staleness, throughput, and
  the production state of every policy (``run_view.py``); curves are inline SVG drawn here
  (``charts.py``).

Everything ships in this package (Jinja templates in ``templates/``, inline CSS and a little
inline script): no build step, nothing fetched from the network. Only the admin token opens
it (``auth.py``): given once (the login form, or ``?token=``), then held in an HttpOnly,
SameSite=Strict cookie that never carries the token itself.
"""
