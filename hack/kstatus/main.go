// kstatus prints what sigs.k8s.io/cli-utils/pkg/kstatus computes for Kubernetes objects: the status a
// GitOps tool (Flux, kpt, cli-utils' apply --wait) reads from them.
//
// Input on stdin: one JSON object, or a JSON object with "items" (a List, as `kubectl get -o json` prints it).
// Output on stdout: one JSON line per object, {"kind", "name", "status", "message"}, where status is one of
// InProgress, Failed, Current, Terminating, NotFound, Unknown.
package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/cli-utils/pkg/kstatus/status"
)

type result struct {
	Kind    string `json:"kind"`
	Name    string `json:"name"`
	Status  string `json:"status"`
	Message string `json:"message"`
}

func main() {
	data, err := io.ReadAll(os.Stdin)
	if err != nil {
		fail(err)
	}
	// Kubernetes' own JSON decoding for unstructured objects: integers stay int64, as the API server sends them.
	decoded, _, err := unstructured.UnstructuredJSONScheme.Decode(data, nil, nil)
	if err != nil {
		fail(err)
	}
	var objects []*unstructured.Unstructured
	switch obj := decoded.(type) {
	case *unstructured.UnstructuredList:
		for i := range obj.Items {
			objects = append(objects, &obj.Items[i])
		}
	case *unstructured.Unstructured:
		objects = append(objects, obj)
	default:
		fail(fmt.Errorf("not an object or a list: %T", decoded))
	}
	out := json.NewEncoder(os.Stdout)
	for _, u := range objects {
		res, err := status.Compute(u)
		if err != nil {
			fail(fmt.Errorf("%s %s: %w", u.GetKind(), u.GetName(), err))
		}
		if err := out.Encode(result{u.GetKind(), u.GetName(), res.Status.String(), res.Message}); err != nil {
			fail(err)
		}
	}
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "kstatus:", err)
	os.Exit(1)
}
