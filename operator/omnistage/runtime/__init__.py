"""The operator at run time: the reconcile pass and its executor, the watch-fed stores, the work
queue, leader election, the API and head clients, kopf's handlers and the metrics. The only layer
that talks to the API server or a head."""
