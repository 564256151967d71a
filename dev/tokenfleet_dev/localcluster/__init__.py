"""The embedded local control plane: etcd, kube-apiserver, controller-manager, scheduler, KWOK nodes, pod runner."""
