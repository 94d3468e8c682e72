"""`servelm simulate`: servelm's own scheduler, KV cache and router policies on a virtual clock.

    profile.json ──▶ SimReplica × N (the real Scheduler + KVCacheManager; the forward replaced by
                     the profile's step cost)  ◀── Fleet (events in time order; the real routing
                     policy over router.replicas.Replica records)  ◀── a `servelm bench` workload
                 ──▶ bench records ──▶ run.json / summary.md, as `servelm bench run` writes them

profile.py    CostProfile: what a step costs on one machine (calibrated, or a labelled roofline)
calibrate.py  `servelm simulate calibrate`: a real server's steps traced on this host, the profile fitted
plan_driver.py  the profiling traffic calibrate sends it
roofline.py   an estimated profile for a device not at hand (H100, H200), labelled as one
run.py        `servelm simulate run`: workload → fleet → bench's reports, labelled simulated
replica.py    SimReplica: one engine's scheduling, step by step, in virtual time
fleet.py      Fleet: arrivals, routing, replicas' steps, request records
workload.py   the bench's profiles and arrival processes, without a server
cli.py        `servelm simulate calibrate | roofline | run`
"""
