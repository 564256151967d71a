"""The Kopf shell: reconcile functions that gather inputs, call the pure
core, and carry out its plan; and the Kopf registrations that trigger them.
"""
